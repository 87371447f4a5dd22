"""Priority under overload: two classes of requests at once, more than the mesh serves together; TTFT per class.

    python benchmarks/priority.py --requests 48 --json out/priority.json

Starts `aflex up` (default model), then sends `requests` streamed chat completions at once, every other one
with `priority` 0 (served first) and the rest with `--low-priority` (1), all alike otherwise, and the same
burst again with no priority given (the baseline: one class). Prints and writes each class's TTFT
percentiles and statuses. Aging moves a waiting request up one level every `priority_aging_s` (10 s), so the
low class's tail is bounded, not starved; requests the queue deadline sheds come back as 429s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import openai

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tools.launch import aflex_up


async def one(client: openai.AsyncOpenAI, model: str, priority: int | None, max_tokens: int) -> tuple[str, float]:
    """(status, TTFT in seconds; nan when refused) of one streamed request."""
    start = time.perf_counter()
    extra = {} if priority is None else {"priority": priority}
    try:
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Tell me a long story about a lighthouse."}],
            max_tokens=max_tokens, temperature=0.0, stream=True, extra_body={"ignore_eos": True, **extra})
        ttft = float("nan")
        async for chunk in stream:
            if ttft != ttft and chunk.choices and chunk.choices[0].delta.content:
                ttft = time.perf_counter() - start
        return "200", ttft
    except openai.APIStatusError as exc:
        return str(exc.status_code), float("nan")


def percentiles(values: list[float]) -> dict[str, float | None]:
    values = [v for v in values if v == v]
    if not values:
        return {"n": 0, "p50_s": None, "p90_s": None, "max_s": None}
    q = statistics.quantiles(values, n=10) if len(values) > 1 else [values[0]] * 9
    return {"n": len(values), "p50_s": round(statistics.median(values), 3), "p90_s": round(q[8], 3),
            "max_s": round(max(values), 3)}


async def burst(base_url: str, model: str, priorities: list[int | None], max_tokens: int) -> dict[str, Any]:
    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600) as client:
        results = await asyncio.gather(*(one(client, model, p, max_tokens) for p in priorities))
    out: dict[str, Any] = {}
    for cls in sorted({p for p in priorities}, key=lambda p: -1 if p is None else p):
        mine = [r for r, p in zip(results, priorities, strict=True) if p == cls]
        statuses: dict[str, int] = {}
        for status, _ in mine:
            statuses[status] = statuses.get(status, 0) + 1
        out["none" if cls is None else str(cls)] = {"ttft": percentiles([t for _, t in mine]), "statuses": statuses}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--low-priority", type=int, default=1)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    two = [0 if k % 2 == 0 else args.low_priority for k in range(args.requests)]
    with aflex_up(args.model) as mesh:
        model = mesh.served_model()
        asyncio.run(burst(mesh.base_url, model, [None] * 4, args.max_tokens))  # warm: kernels, first-call costs
        baseline = asyncio.run(burst(mesh.base_url, model, [None] * args.requests, args.max_tokens))
        classes = asyncio.run(burst(mesh.base_url, model, two, args.max_tokens))  # type: ignore[arg-type]
    doc = {"requests": args.requests, "max_tokens": args.max_tokens, "model": args.model,
           "one_class": baseline, "two_classes": classes}
    for name, res in (("one class", baseline), ("two classes", classes)):
        for cls, r in res.items():
            t = r["ttft"]
            print(f"{name:12s} priority {cls:>4s}: TTFT p50 {t['p50_s']} s  p90 {t['p90_s']} s  max {t['max_s']} s  "
                  f"statuses {r['statuses']}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
