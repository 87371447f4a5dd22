"""The front door and the process manager: the `aflex` command (cli.py), `aflex up`'s supervisor and the
children it starts (the embedded nats-server, the services, the GPUs they are pinned to), and `aflex top`."""
