"""Offer a mesh more than it can serve, open loop, and record what every request got back.

`capacity` measures what the mesh finishes per second with `concurrency` clients in a closed loop;
`overload` then sends requests at a fixed rate (a multiple of that) whatever comes back, as a crowd
of clients would. A mesh that sheds load well answers the excess at once with 429 and `Retry-After`,
serves the rest within its latency bound, and never times out, drops a connection or errors.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx2 as httpx


@dataclass
class OverloadResult:
    offered_per_s: float
    seconds: float
    statuses: Counter[int] = field(default_factory=Counter)  # HTTP status -> requests
    without_retry_after: int = 0  # 429s that did not say when to come back
    refusal_codes: Counter[str] = field(default_factory=Counter)  # the error codes of the 429s
    failures: list[str] = field(default_factory=list)  # timeouts, dropped connections, broken streams
    served_ttft_s: list[float] = field(default_factory=list)
    served_e2e_s: list[float] = field(default_factory=list)
    served_tpot_s: list[float] = field(default_factory=list)  # (last chunk - first) / (chunks - 1)


def _body(model: str, i: int, max_tokens: int) -> dict[str, object]:
    return {"model": model, "messages": [{"role": "user", "content": f"Tell me about request {i}."}],
            "max_tokens": max_tokens, "stream": True, "ignore_eos": True}


async def _one(client: httpx.AsyncClient, url: str, body: dict[str, object], result: OverloadResult) -> None:
    started = time.monotonic()
    first: float | None = None
    last = 0.0
    chunks = 0
    try:
        async with client.stream("POST", url, json=body) as response:
            result.statuses[response.status_code] += 1
            if response.status_code == 429 and "retry-after" not in response.headers:
                result.without_retry_after += 1
            if response.status_code != 200:
                answer = await response.aread()
                if response.status_code == 429:
                    result.refusal_codes[str(json.loads(answer).get("error", {}).get("code"))] += 1
                return
            done = False
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.failures.append(f"error event: {chunk['error'].get('message')}")
                    return
                if any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                    last = time.monotonic()
                    first = last if first is None else first
                    chunks += 1
            if not done:
                result.failures.append("the stream ended without [DONE]")
                return
    except httpx.HTTPError as exc:
        result.failures.append(f"{type(exc).__name__}: {exc}")
        return
    end = time.monotonic()
    result.served_e2e_s.append(end - started)
    if first is not None:
        result.served_ttft_s.append(first - started)
    if chunks > 1 and first is not None:
        result.served_tpot_s.append((last - first) / (chunks - 1))


async def capacity(base_url: str, model: str, *, seconds: float, concurrency: int, max_tokens: int) -> float:
    """Requests finished per second by `concurrency` clients that each send the next when one ends."""
    result = OverloadResult(0.0, seconds)
    deadline = time.monotonic() + seconds
    async with httpx.AsyncClient(timeout=120) as client:
        async def loop(k: int) -> None:
            i = 0
            while time.monotonic() < deadline:
                await _one(client, f"{base_url}/chat/completions", _body(model, k * 100_000 + i, max_tokens), result)
                i += 1

        started = time.monotonic()
        await asyncio.gather(*(loop(k) for k in range(concurrency)))
        return len(result.served_e2e_s) / (time.monotonic() - started)


async def overload(base_url: str, model: str, *, rate_per_s: float, seconds: float, max_tokens: int,
                   timeout_s: float = 120.0) -> OverloadResult:
    """`rate_per_s` requests a second for `seconds`, open loop; waits for every answer."""
    result = OverloadResult(rate_per_s, seconds)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        tasks: list[asyncio.Task[None]] = []
        start = time.monotonic()
        for i in range(int(rate_per_s * seconds)):
            await asyncio.sleep(max(0.0, start + i / rate_per_s - time.monotonic()))  # the arrival schedule
            tasks.append(asyncio.create_task(_one(client, f"{base_url}/chat/completions",
                                                  _body(model, i, max_tokens), result)))
        await asyncio.gather(*tasks)
    return result
