"""A fault campaign against a running `aflex up`: a steady mixed load through three phases, faults in the middle.

1. standard: the load with nothing failing (each (kind, k) pair's answer is first recorded here, alone);
2. fault: the same load while `Injector` kills and hangs processes at random times (exponential gaps);
3. recovery: the load again, no faults.
Every request is checked (`requests.run`): its answer must equal the recorded one token for token, or it
must end with an OpenAI-style error. The report counts, per phase, what each request came to, the typed
errors by code, TTFT and latency percentiles; per fault, the time until a request sent after it completed
whole. One seed fixes the requests, the faults and their times (the mesh's own timing still varies).
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import openai

from services.scheduler.window_clocks import percentile
from tools.chaos.faults import Fault, Injector
from tools.chaos.requests import KINDS, Outcome, run

PAIRS_PER_KIND = 3
FAILURES = ("mismatch", "untyped_error", "cut", "hung", "bad_usage")  # the statuses that break the promise


@dataclass(frozen=True)
class Plan:
    seed: int
    standard_s: float
    fault_s: float
    recovery_s: float
    concurrency: int
    fault_gap_s: float  # mean gap between faults
    bound_s: float  # a request not ended by then is hung


def _percentile(values: list[float], q: float) -> float | None:
    value = percentile(values, q)
    return None if value is None else round(value, 3)


def phase_figures(outcomes: list[Outcome], seconds: float) -> dict[str, Any]:
    statuses = Counter(o.status for o in outcomes)
    ttfts = [o.ttft_s for o in outcomes if o.ttft_s is not None and o.status == "ok"]
    latencies = [o.ended - o.started for o in outcomes if o.status == "ok"]
    tpots = [(o.ended - o.started - o.ttft_s) / (o.tokens - 1) for o in outcomes
             if o.status == "ok" and o.ttft_s is not None and o.tokens > 1]
    return {"requests": len(outcomes), "served_per_s": round(statuses["ok"] / seconds, 3) if seconds else None,
            "by_status": dict(statuses), "retried": sum(o.retried for o in outcomes),
            "typed_errors": dict(Counter(o.error for o in outcomes if o.status == "typed_error")),
            "failures": [o.to_json() | {"detail": o.error} for o in outcomes if o.status in FAILURES],
            "ttft_p50_s": _percentile(ttfts, 50), "ttft_p99_s": _percentile(ttfts, 99),
            "tpot_p50_s": _percentile(tpots, 50), "tpot_p99_s": _percentile(tpots, 99),
            "latency_p50_s": _percentile(latencies, 50), "latency_p99_s": _percentile(latencies, 99)}


class Campaign:
    def __init__(self, plan: Plan, base_urls: list[str], injector: Injector) -> None:
        self.plan, self.injector = plan, injector
        self.clients = [openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=plan.bound_s)
                        for url in base_urls]
        self.reference: dict[tuple[str, int], list[str]] = {}
        self.outcomes: list[Outcome] = []
        self.faults: list[Fault] = []

    async def _record_references(self, model: str) -> None:
        for kind in KINDS:
            for k in range(PAIRS_PER_KIND):
                out = await run(self.clients, model, kind, k, 0, self.plan.bound_s)
                if out.status != "ok":
                    raise RuntimeError(f"no reference for {kind} {k}: {out.status} {out.error}")
                self.reference[kind, k] = out.answer

    async def _client(self, model: str, i: int, until: float) -> None:
        rng = random.Random(self.plan.seed * 1000 + i)
        while time.monotonic() < until:
            kind, k = rng.choice(KINDS), rng.randrange(PAIRS_PER_KIND)
            out = await run(self.clients, model, kind, k, rng.randrange(len(self.clients)), self.plan.bound_s)
            if out.status == "ok" and out.answer != self.reference[kind, k]:
                out.status, out.error = "mismatch", f"{out.answer!r} != {self.reference[kind, k]!r}"
            self.outcomes.append(out)

    async def _faults(self, start: float, until: float) -> None:
        rng = random.Random(self.plan.seed)
        await asyncio.sleep(max(0.0, start - time.monotonic()))
        while True:
            gap_s = min(rng.expovariate(1.0 / self.plan.fault_gap_s), 3 * self.plan.fault_gap_s)
            if time.monotonic() + gap_s >= until:
                return
            await asyncio.sleep(gap_s)
            self.faults.append(await asyncio.to_thread(self.injector.inject, rng.choice(self.injector.kinds())))

    async def run(self) -> dict[str, Any]:
        p = self.plan
        model = (await self.clients[0].models.list()).data[0].id
        await self._record_references(model)
        t0 = time.monotonic()
        bounds = [t0, t0 + p.standard_s, t0 + p.standard_s + p.fault_s, t0 + p.standard_s + p.fault_s + p.recovery_s]
        await asyncio.gather(self._faults(bounds[1], bounds[2]),
                             *(self._client(model, i, bounds[3]) for i in range(p.concurrency)))
        await asyncio.to_thread(self.injector.close)
        for client in self.clients:
            await client.close()
        return self.report(bounds)

    def report(self, bounds: list[float]) -> dict[str, Any]:
        for fault in self.faults:
            after = [o.ended - fault.at for o in self.outcomes if o.started >= fault.at and o.status == "ok"]
            fault.recovered_s = round(min(after), 3) if after else None
        phases = {}
        for name, start, end in zip(("standard", "fault", "recovery"), bounds, bounds[1:], strict=False):
            phases[name] = phase_figures([o for o in self.outcomes if start <= o.started < end], end - start)
        injected = [f for f in self.faults if not f.skipped]
        recovered = [f.recovered_s for f in injected if f.recovered_s is not None]
        return {
            "plan": self.plan.__dict__, "phases": phases,
            "faults": {"injected": len(injected), "skipped": len(self.faults) - len(injected),
                       "by_kind": dict(Counter(f.kind for f in injected)),
                       "by_target": dict(Counter(f"{f.kind} {f.target}" for f in injected)),
                       "recovered_p50_s": statistics.median(recovered) if recovered else None,
                       "recovered_max_s": max(recovered) if recovered else None,
                       "never_recovered": sum(f.recovered_s is None for f in injected),
                       "list": [f.to_json() for f in self.faults]},
            "totals": {"requests": len(self.outcomes),
                       "lost": sum(o.status in ("cut", "untyped_error") for o in self.outcomes),
                       "hung": sum(o.status == "hung" for o in self.outcomes),
                       "mismatched": sum(o.status == "mismatch" for o in self.outcomes),
                       "bad_usage": sum(o.status == "bad_usage" for o in self.outcomes),
                       "typed_errors": sum(o.status == "typed_error" for o in self.outcomes)},
        }
