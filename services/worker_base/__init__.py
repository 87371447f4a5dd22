"""What both worker kinds share, one job a module: loading a model half (`loading.py`), registration,
heartbeats and the role the scheduler assigns (`presence.py`), the worker's GPU with its clock commands
and telemetry (`gpu.py`), cold parking (`parking.py`), and one FFN forward run and accounted on the
worker's GPU, the FFN worker's and a colocated attention worker's (`ffn_forward.py`)."""
