"""NATS connections for every service: all four callbacks, endless reconnect, explicit timeouts.

Services never call `nats.connect` themselves: `connect()` here logs disconnects, reconnects,
errors and closure under the service's name, and `request()` turns NATS's timeout and
no-responders into typed errors that say which subject did not answer.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import unquote, urlsplit

import nats
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from shared.errors import AFlexError
from shared.messages import ProtocolError

log = logging.getLogger("aflex.bus")

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
MAX_PAYLOAD_BYTES = 8 * 1024 * 1024  # what the embedded and compose nats.conf set


class BusError(AFlexError):
    """The message bus could not deliver: no connection, nobody listening, or no reply in time."""


class BusTimeoutError(BusError):
    def __init__(self, subject: str, timeout_s: float) -> None:
        super().__init__(f"no reply on {subject} within {timeout_s:.1f} s")
        self.subject = subject


class NoRespondersBusError(BusError):
    def __init__(self, subject: str) -> None:
        super().__init__(f"nobody is subscribed to {subject}")
        self.subject = subject


def url_credentials(url: str) -> tuple[str, str]:
    """The user and password of the first server in `url` that names both, or ("", "") (a token alone stays in
    the URL, where nats-py takes it from). Passed as options, not left in the URL: nats-py sends a URL's
    credentials to that URL's server only, and nothing to the nodes a cluster tells it of (which it fails
    over to), where the login then fails (`Authorization Violation`)."""
    for server in server_list(url):
        parts = urlsplit(server)
        if parts.username and parts.password is not None:
            return unquote(parts.username), unquote(parts.password)
    return "", ""


def server_list(url: str) -> list[str]:
    """`url` may name several servers of one cluster, comma-separated: the first is tried first, and
    when a connection drops nats-py goes on to the next (`aflex up --nats-cluster` lists them from a
    different node for each service, to spread them)."""
    return [u.strip() for u in url.split(",") if u.strip()]


async def connect(url: str, name: str, *, connect_timeout_s: float = 5.0, first_connect_timeout_s: float = 30.0,
                  reconnect_wait_s: float = 0.5, on_disconnect: Callable[[], None] | None = None,
                  user: str = "", password: str = "", **options: Any) -> Client:
    """Connect with logging callbacks; once connected, reconnects forever (a restarted nats-server
    is picked up). The first connection gives up after `first_connect_timeout_s` with a `BusError`:
    nats-py would otherwise retry an unreachable server forever. `on_disconnect()` runs on every
    drop, and when a slow subscription had messages dropped: a message sent or received around it
    may be lost (NATS core is at most once).
    """

    async def error_cb(exc: Exception) -> None:
        log.warning("%s: NATS error: %s", name, exc)
        if isinstance(exc, nats.errors.SlowConsumerError) and on_disconnect is not None:
            on_disconnect()  # messages were dropped, as in a disconnection

    async def disconnected_cb() -> None:
        log.warning("%s: disconnected from NATS", name)
        if on_disconnect is not None:
            on_disconnect()

    async def reconnected_cb() -> None:
        log.info("%s: reconnected to NATS at %s", name, nc.connected_url.netloc if nc.connected_url else url)

    async def closed_cb() -> None:
        log.info("%s: NATS connection closed", name)

    if not user:  # the URL's own (nats://user:password@host:port), for every server: see url_credentials
        user, password = url_credentials(url)
    if user:
        options |= {"user": user, "password": password}
    try:
        nc: Client = await asyncio.wait_for(nats.connect(
            servers=server_list(url), name=name, connect_timeout=connect_timeout_s,
            reconnect_time_wait=reconnect_wait_s, max_reconnect_attempts=-1, allow_reconnect=True,
            dont_randomize=True, error_cb=error_cb,
            disconnected_cb=disconnected_cb, reconnected_cb=reconnected_cb, closed_cb=closed_cb, **options,
        ), timeout=first_connect_timeout_s)
    except TimeoutError:
        raise BusError(f"{name}: cannot connect to NATS at {url} within {first_connect_timeout_s:.0f} s") from None
    except Exception as exc:  # nats raises several unrelated types for "cannot connect"
        raise BusError(f"{name}: cannot connect to NATS at {url}: {exc}") from None
    return nc


async def request(nc: Client, subject: str, payload: bytes, timeout_s: float) -> bytes:
    """Request/reply with an explicit timeout; typed errors for timeout and no responders."""
    try:
        msg = await nc.request(subject, payload, timeout=timeout_s)
    except NoRespondersError:
        raise NoRespondersBusError(subject) from None
    except NatsTimeoutError:
        raise BusTimeoutError(subject, timeout_s) from None
    return bytes(msg.data)


async def close(nc: Client) -> None:
    """Drain (deliver what is in flight, then close); fall back to close if draining fails."""
    if nc.is_closed:
        return
    try:
        await nc.drain()
    except Exception:  # already closing / connection lost: nothing left to drain
        await nc.close()


def guarded(handler: Callable[[Msg], Awaitable[None]], logger: logging.Logger) -> Callable[[Msg], Awaitable[None]]:
    """A NATS callback that logs a malformed message (or any error handling it) and never kills the
    subscription."""
    async def cb(msg: Msg) -> None:
        try:
            await handler(msg)
        except ProtocolError as exc:
            logger.warning("dropped a message on %s: %s", msg.subject, exc)
        except Exception:
            logger.exception("error handling a message on %s", msg.subject)
    return cb


async def publish_every(nc: Client, subject: str, message: Callable[[], bytes], period_s: float) -> None:
    """Publish `message()` on `subject` every `period_s` until cancelled (a heartbeat). A publish that
    fails while the connection is reconnecting is skipped: the next one tries again."""
    while True:
        try:
            await nc.publish(subject, message())
        except Exception as exc:
            log.debug("%s not sent: %s", subject, exc)
        await asyncio.sleep(period_s)
