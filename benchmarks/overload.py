"""Overload: offer the mesh N times what it can serve, open loop, and see that it sheds load cleanly.

    python benchmarks/overload.py --factor 10 --seconds 60 --json out/overload.json

Starts `aflex up` (default model), measures its capacity (requests finished per second by a few
closed-loop clients), then sends `factor` x that rate for `seconds`. Prints and writes: the statuses
(the excess should be 429s with Retry-After, never timeouts or dropped streams), the served
requests' TTFT and end-to-end latency percentiles against a no-overload run, the gateway's and
scheduler's RSS before and after, and whether the mesh serves normally right after.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from loadgen.overload import OverloadResult, capacity, overload
from tools.launch import aflex_up


def percentiles(values: list[float]) -> dict[str, float | None]:
    if len(values) < 2:
        return {"p50_s": values[0] if values else None, "p90_s": values[0] if values else None}
    q = statistics.quantiles(values, n=10)
    return {"p50_s": round(statistics.median(values), 4), "p90_s": round(q[8], 4)}


def summary(result: OverloadResult) -> dict[str, object]:
    return {"offered_per_s": round(result.offered_per_s, 2), "seconds": result.seconds,
            "statuses": dict(result.statuses), "without_retry_after": result.without_retry_after,
            "refusal_codes": dict(result.refusal_codes),
            "failures": len(result.failures), "failure_examples": result.failures[:5],
            "served": len(result.served_e2e_s), "ttft": percentiles(result.served_ttft_s),
            "e2e": percentiles(result.served_e2e_s), "tpot": percentiles(result.served_tpot_s)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--factor", type=float, default=10.0, help="offered load, in multiples of capacity")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=32, help="closed-loop clients measuring capacity")
    parser.add_argument("--queue-deadline", type=float, default=None, help="the scheduler's queue_deadline_s "
                        "(default: its default)")
    parser.add_argument("--running-bound", choices=("auto", "slo", "off"), default=None,
                        help="the scheduler's running_bound (default: its default)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    env = {} if args.queue_deadline is None else {"AFLEX_QUEUE_DEADLINE_S": str(args.queue_deadline)}
    if args.running_bound is not None:
        env["AFLEX_RUNNING_BOUND"] = args.running_bound
    with aflex_up(args.model, env_extra=env) as mesh:
        model = mesh.served_model()
        rss_before = {name: round(mesh.rss_mb(name), 1) for name in ("gateway", "scheduler")}
        rate = asyncio.run(capacity(mesh.base_url, model, seconds=10, concurrency=args.concurrency,
                                    max_tokens=args.max_tokens))
        calm = asyncio.run(overload(mesh.base_url, model, rate_per_s=rate * 0.5, seconds=10,
                                    max_tokens=args.max_tokens))
        heavy = asyncio.run(overload(mesh.base_url, model, rate_per_s=rate * args.factor, seconds=args.seconds,
                                     max_tokens=args.max_tokens))
        rss_after = {name: round(mesh.rss_mb(name), 1) for name in ("gateway", "scheduler")}
        after = asyncio.run(overload(mesh.base_url, model, rate_per_s=rate * 0.5, seconds=5,
                                     max_tokens=args.max_tokens))
        bounds = [line.strip()[-200:] for line in mesh.output().splitlines() if "its running set is" in line]
    report = {"capacity_per_s": round(rate, 2), "factor": args.factor, "max_tokens": args.max_tokens,
              "queue_deadline_s": args.queue_deadline, "running_bound": args.running_bound,
              "running_set_bounds_logged": bounds[:20],
              "half_capacity": summary(calm), "overload": summary(heavy), "after": summary(after),
              "rss_mb_before": rss_before, "rss_mb_after": rss_after}
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
