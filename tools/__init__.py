"""Tools around the mesh: the `aflex top` view, the protocol doc generator, the launch harness for tests and
benchmarks. They use the services; no service imports them."""
