"""The OpenAI-compatible HTTP gateway: tokenizes, validates, submits to the scheduler over NATS, streams back.

Entry points: `services.gateway.app.create_app(settings, card, nc)` (an ASGI app, for tests and embedding)
and `services.gateway.app.serve(settings)` (model card + NATS + uvicorn, until stopped). Nothing here
imports torch: the gateway installs with the base dependencies only.
"""
