"""A request body over `max_body_bytes` is refused with 413 before it is parsed or tokenized.

Pure ASGI, so it sees the bytes as they arrive: a declared `Content-Length` over the limit is refused
at once (the HTTP server holds a body to its declared length); a body without one (chunked) is read
up to the limit here, refused as soon as it passes it, and otherwise handed on whole.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.gateway.errors import APIError


class BodyLimit:
    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app, self.max_body_bytes = app, max_body_bytes

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = APIError(413, f"the request body is larger than the gateway's limit of {self.max_body_bytes} "
                              "bytes (max_body_bytes)", code="request_too_large")
        await error.response()(scope, receive, send)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None:
            if declared.isdigit() and int(declared) > self.max_body_bytes:
                await self._refuse(scope, receive, send)
                return
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away before the end
                await self.app(scope, _replay([message], receive), send)
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body_bytes:
                await self._refuse(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        whole: Message = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, _replay([whole], receive), send)


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """`messages` first, then the connection's own (a streaming response watches it for a disconnect)."""
    pending = list(messages)

    async def replayed() -> Message:
        return pending.pop(0) if pending else await receive()

    return replayed
