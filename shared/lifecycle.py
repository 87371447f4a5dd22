"""How every AFlex process stops: SIGTERM / SIGINT set an `asyncio.Event`, and the service drains.

One helper for the workers, the gateway and `aflex top`, so that a signal always means a clean
drain (deliver what is in flight, reset clocks, close NATS) and never a traceback mid-request.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Iterator


@contextlib.contextmanager
def stop_on_signals(stop: asyncio.Event) -> Iterator[None]:
    """SIGTERM / SIGINT set `stop` while inside; the handlers are removed on exit.

    Outside the main thread (tests running a service in a thread) or where the loop has no signal
    support, nothing is installed and only `stop` ends the service.
    """
    loop = asyncio.get_running_loop()
    installed: list[signal.Signals] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
            installed.append(sig)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or no signals here
            pass
    try:
        yield
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)
