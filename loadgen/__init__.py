"""Load generator: replay traces (or Poisson/gamma/fixed workloads) against AFlex or any OpenAI-compatible server.

workloads.py what and when (Azure traces, vLLM's arrival process, presets); prompts.py exact-length
prompts; client.py the async streaming client; metrics.py vLLM's metric arithmetic; energy.py
telemetry over NATS; report.py table, JSON, plots; cli.py `python -m loadgen` / `aflex bench`.
"""
