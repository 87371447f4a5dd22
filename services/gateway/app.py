"""The gateway's FastAPI app and its server loop.

`create_app(settings, card, nc)` builds the app on an open NATS connection (tests use it directly); its
`lifespan` starts and stops what the gateway runs on that connection. `serve(settings)` opens the model card,
connects to NATS and runs uvicorn on the same event loop until `stop` is set or SIGTERM/SIGINT arrives, then
closes the connection. The API's routes are services.gateway.routes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator, Iterator

import uvicorn
from fastapi import APIRouter, FastAPI
from nats.aio.client import Client
from starlette.responses import Response

from services.gateway import liveness, routes, tokenize
from services.gateway import metrics as gateway_metrics
from services.gateway.body_limit import BodyLimit
from services.gateway.context import (
    Gateway,
    GatewayDep,
    new_gateway_id,
)
from services.gateway.errors import (
    JSONResponse,
    install_error_handlers,
)
from services.gateway.openapi_doc import document
from shared import subjects
from shared.errors import TokenizerError
from shared.lifecycle import stop_on_signals
from shared.messages import ProtocolError, SchedulerStatus, decode
from shared.model.checkpoint import ModelCard, open_model_card
from shared.settings import GatewaySettings
from shared.transport import bus

log = logging.getLogger("aflex.gateway")

STATUS_TIMEOUT_S = 2.0  # /ready: how long the scheduler may take to answer


# -- probes ---------------------------------------------------------------------------------------

probes = APIRouter()


@probes.get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}


@probes.get("/ready")
async def ready(gateway: GatewayDep) -> Response:
    try:
        data = await bus.request(gateway.nc, subjects.SCHED_STATUS, b"{}", STATUS_TIMEOUT_S)
        status = decode(SchedulerStatus, data)
    except (bus.BusError, ProtocolError, OSError) as exc:
        return JSONResponse({"status": "not_ready", "reason": str(exc)}, status_code=503,
                            headers={"Retry-After": "1"})
    except Exception as exc:  # nats raises its own types when the connection is down
        return JSONResponse({"status": "not_ready", "reason": f"NATS: {exc!r}"}, status_code=503,
                            headers={"Retry-After": "1"})
    body = {"status": "ready" if status.ready else "not_ready", "scheduler": status.model_dump(mode="json")}
    return JSONResponse(body, status_code=200 if status.ready else 503,
                        headers={} if status.ready else {"Retry-After": "1"})


# -- app and server -------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """The gateway's start and stop on its NATS connection: telemetry and scheduler liveness watched, this
    gateway's own heartbeat sent, from before the first request until the server has drained."""
    gateway: Gateway = app.state.gateway
    await app.state.metrics.subscribe(gateway.nc)
    await gateway.schedulers.subscribe(gateway.nc)
    beats = asyncio.create_task(liveness.heartbeat_loop(gateway.nc, gateway.gateway_id, gateway.settings.heartbeat_s))
    try:
        yield
    finally:
        beats.cancel()


def create_app(settings: GatewaySettings, card: ModelCard, nc: Client) -> FastAPI:
    if card.tokenizer is None:
        raise TokenizerError(f"{card.path} ships no tokenizer: the gateway needs one to serve text")
    app = FastAPI(title="AFlex gateway", version="1", default_response_class=JSONResponse, lifespan=lifespan)
    app.state.gateway = Gateway(settings, card, card.tokenizer, nc, settings.served_model_name or card.model_id,
                                int(time.time()), gateway_id=settings.gateway_id or new_gateway_id())
    install_error_handlers(app)
    app.add_middleware(BodyLimit, max_body_bytes=settings.max_body_bytes)
    document(app)
    gateway_metrics.install(app)
    app.include_router(probes)
    app.include_router(routes.api)
    app.include_router(tokenize.router)
    return app


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: `serve()` owns SIGTERM/SIGINT and shuts down cleanly (uvicorn's
    own would raise the captured signal again after the drain, and end the process by it)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def serve(settings: GatewaySettings, *, stop: asyncio.Event | None = None) -> None:
    """Run the gateway until `stop` is set (or SIGTERM/SIGINT in the main thread); then close NATS."""
    stop = stop or asyncio.Event()
    card = await asyncio.to_thread(open_model_card, settings.model)
    nc = await bus.connect(settings.nats_url, "aflex-gateway", user=settings.nats_user, password=settings.nats_password)
    try:
        app = create_app(settings, card, nc)
        gateway: Gateway = app.state.gateway
        config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level.lower(),
                                lifespan="on", access_log=False,
                                timeout_graceful_shutdown=math.ceil(settings.drain_timeout_s))  # SIGTERM: streams end
        server = _Server(config)

        async def stop_when_asked() -> None:
            """SIGTERM: uvicorn closes the listener (no new connections) and lets open responses end, streams
            included, for up to drain_timeout_s."""
            await stop.wait()
            log.info("gateway %s draining: %d connections open, up to %g s", gateway.gateway_id,
                     len(server.server_state.connections), settings.drain_timeout_s)
            server.should_exit = True

        watcher = asyncio.create_task(stop_when_asked())
        try:
            log.info("gateway %s serving %s on http://%s:%d (NATS %s)", gateway.gateway_id, gateway.served_model,
                     settings.host, settings.port, settings.nats_url)
            with stop_on_signals(stop):
                await server.serve()
            if stop.is_set() and not server.server_state.tasks:
                log.info("gateway %s drained", gateway.gateway_id)
        finally:
            watcher.cancel()
    finally:
        await bus.close(nc)
