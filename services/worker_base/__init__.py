"""What both worker kinds share, one job a module: loading a model half (`loading.py`), registration
and heartbeats (`presence.py`), and the worker's GPU with its clock commands and telemetry (`gpu.py`)."""
