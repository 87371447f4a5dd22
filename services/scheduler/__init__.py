"""The global scheduler: admission, routing, batching, microbatch dispatch and failure handling.

Entry point: `services.scheduler.main.run(settings)`.
"""
