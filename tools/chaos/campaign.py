"""A fault campaign against a running `aflex up`: a steady mixed load through three phases, faults in the middle.

1. standard: the load with nothing failing (each (kind, k) pair's answer is first recorded here, alone);
2. fault: the same load while `Injector` kills and hangs processes at random times (exponential gaps);
3. recovery: the load again, no faults.
Every request is checked (`requests.run`): its answer must equal the recorded one token for token, or it
must end with an OpenAI-style error. The report counts, per phase, what each request came to, the typed
errors by code, TTFT and latency percentiles; per fault, the time until a request sent after it completed
whole (`answered_s`) and the time until the mesh served at the standard phase's rate again (`recovered_s`:
until the start of the first `RATE_WINDOW_S` in which it completed at least `RATE_SHARE` of the standard
phase's requests per second; later faults inside that time count against it, as they would in production).
One seed fixes the requests, the faults, their kinds and times (the mesh's own timing still varies).
"""

from __future__ import annotations

import asyncio
import bisect
import random
import re
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import openai

from services.scheduler.window_clocks import percentile
from tools.chaos.faults import TARGETED, Fault, Injector
from tools.chaos.requests import KINDS, Outcome, run

PAIRS_PER_KIND = 3
RATE_WINDOW_S, RATE_SHARE = 10.0, 0.8  # "serving at the standard rate again": 80 % of it over 10 s
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
            "failures": [o.to_json() for o in outcomes if o.status in FAILURES],
            "typed_error_list": [o.to_json() for o in outcomes if o.status == "typed_error"],
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
            kind = rng.choice(self.injector.kinds())
            self.faults.append(await self.injector.inject_targeted(kind, until) if kind in TARGETED
                               else await asyncio.to_thread(self.injector.inject, kind))

    async def run(self) -> dict[str, Any]:
        p = self.plan
        model = (await self.clients[0].models.list()).data[0].id
        if self.injector.watch is not None:
            await self.injector.watch.open()
        await self._record_references(model)
        t0 = time.monotonic()
        bounds = [t0, t0 + p.standard_s, t0 + p.standard_s + p.fault_s, t0 + p.standard_s + p.fault_s + p.recovery_s]
        await asyncio.gather(self._faults(bounds[1], bounds[2]),
                             *(self._client(model, i, bounds[3]) for i in range(p.concurrency)))
        if self.injector.watch is not None:  # while the NATS nodes it restarted still run
            await self.injector.watch.close()
        await asyncio.to_thread(self.injector.close)
        for client in self.clients:
            await client.close()
        return self.report(bounds, self.injector.mesh.output())

    def report(self, bounds: list[float], mesh_log: str = "") -> dict[str, Any]:
        """`mesh_log`: what the mesh printed, where each targeted fault's failure is looked up (`evidence`)."""
        for fault in self.faults:  # the id whole: kv1 is not kv12
            named = re.compile(re.escape(fault.key) + r"(?![\w-])") if fault.key else None
            fault.evidence = next((line.strip()[:400] for line in mesh_log.splitlines()
                                   if named is not None and "failed" in line and named.search(line)), "")
        served = sorted(o.ended for o in self.outcomes if o.status == "ok")
        standard_rps = sum(bounds[0] <= t < bounds[1] for t in served) / (bounds[1] - bounds[0])
        for fault in self.faults:
            after = [o.ended - fault.at for o in self.outcomes if o.started >= fault.at and o.status == "ok"]
            fault.answered_s = round(min(after), 3) if after else None
            fault.recovered_s = recovered_s(served, fault.at, standard_rps, bounds[3])
        phases = {}
        for name, start, end in zip(("standard", "fault", "recovery"), bounds, bounds[1:], strict=False):
            phases[name] = phase_figures([o for o in self.outcomes if start <= o.started < end], end - start)
        injected = [f for f in self.faults if not f.skipped]
        return {
            "plan": self.plan.__dict__, "phases": phases,
            "faults": {"injected": len(injected), "skipped": len(self.faults) - len(injected),
                       "skipped_by_reason": dict(Counter(f"{f.kind}: {f.skipped}" for f in self.faults if f.skipped)),
                       "by_kind": dict(Counter(f.kind for f in injected)),
                       "by_target": dict(Counter(f"{f.kind} {f.target}" for f in injected)),
                       "standard_rps": round(standard_rps, 3),
                       "recovery_rule": f"{RATE_SHARE:.0%} of standard_rps over {RATE_WINDOW_S:g} s",
                       "recovery_by_kind": {kind: recovery_figures([f for f in injected if f.kind == kind])
                                            for kind in sorted({f.kind for f in injected})},
                       **recovery_figures(injected),
                       "targeted_with_evidence": sum(bool(f.evidence) for f in injected),
                       "list": [f.to_json() for f in self.faults]},
            "totals": {"requests": len(self.outcomes),
                       "lost": sum(o.status in ("cut", "untyped_error") for o in self.outcomes),
                       "hung": sum(o.status == "hung" for o in self.outcomes),
                       "mismatched": sum(o.status == "mismatch" for o in self.outcomes),
                       "bad_usage": sum(o.status == "bad_usage" for o in self.outcomes),
                       "typed_errors": sum(o.status == "typed_error" for o in self.outcomes)},
        }


def recovered_s(served: list[float], at: float, standard_rps: float, end: float) -> float | None:
    """From `at` until the first `RATE_WINDOW_S` (starting at `at` or at a completion after it) in which the
    completions in `served` (sorted) reach `RATE_SHARE` of `standard_rps`; None if none did before `end`."""
    wanted = RATE_SHARE * standard_rps * RATE_WINDOW_S
    for start in (at, *served[bisect.bisect_right(served, at):]):
        if start + RATE_WINDOW_S > end:
            return None
        if bisect.bisect_right(served, start + RATE_WINDOW_S) - bisect.bisect_right(served, start) >= wanted:
            return round(start - at, 3)
    return None


def recovery_figures(faults: list[Fault]) -> dict[str, Any]:
    answered = [f.answered_s for f in faults if f.answered_s is not None]
    recovered = [f.recovered_s for f in faults if f.recovered_s is not None]
    return {"answered_p50_s": _percentile(answered, 50), "answered_max_s": max(answered, default=None),
            "recovered_p50_s": _percentile(recovered, 50), "recovered_p90_s": _percentile(recovered, 90),
            "recovered_max_s": max(recovered, default=None),
            "never_recovered": sum(f.recovered_s is None for f in faults)}
