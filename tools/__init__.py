"""Tools around the mesh: the protocol doc generator and the launch harness for tests and benchmarks.
They use the services; no service imports them."""
