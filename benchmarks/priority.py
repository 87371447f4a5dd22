"""Priority under overload: two classes of requests at once, more than the mesh serves together; TTFT per class.

    python benchmarks/priority.py --json out/priority.json

Starts `aflex up` (default model), then sends `requests` streamed chat completions at once, every other one
with `priority` 0 (served first) and the rest with `--low-priority` (1), all alike otherwise, and the same
burst again with no priority given (the baseline: one class). Each prompt is its own (`--prompt-words` words
after a request number), so no prefix is shared and the burst's prefill is more than a few iterations hold:
its order is what priority decides. Prints and writes each class's TTFT
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

STORY = ["keeper", "lamp", "lens", "tide", "fog", "rock", "harbour", "signal", "storm", "night", "beacon", "gull",
         "coast", "wave", "boat", "rope", "bell", "log", "oil", "wick"]


def prompt(index: int, words: int) -> str:
    """A prompt of its own: the request's number first, so no two share a cached prefix."""
    body = " ".join(STORY[(index * 7 + k) % len(STORY)] for k in range(words))
    return f"Request {index}. Tell me a long story about these: {body}."


async def one(client: openai.AsyncOpenAI, model: str, priority: int | None, max_tokens: int,
              text: str) -> tuple[str, float]:
    """(status, TTFT in seconds; nan when refused) of one streamed request."""
    start = time.perf_counter()
    extra = {} if priority is None else {"priority": priority}
    try:
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": text}],
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
    q = statistics.quantiles(values, n=10, method="inclusive") if len(values) > 1 else [values[0]] * 9
    return {"n": len(values), "p50_s": round(statistics.median(values), 3), "p90_s": round(q[8], 3),
            "max_s": round(max(values), 3)}


async def burst(base_url: str, model: str, priorities: list[int | None], max_tokens: int, words: int,
                first: int = 0) -> dict[str, Any]:
    """`priorities[k]` for request `first + k`, all sent at once; TTFT percentiles and statuses per class."""
    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600) as client:
        results = await asyncio.gather(*(one(client, model, p, max_tokens, prompt(first + k, words))
                                         for k, p in enumerate(priorities)))
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
    parser.add_argument("--requests", default="16,48",
                        help="burst sizes, comma-separated (default: one that queues, one the deadline sheds from)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--low-priority", type=int, default=1)
    parser.add_argument("--prompt-words", type=int, default=200, help="words per prompt (each its own)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    sizes = [int(n) for n in args.requests.split(",")]
    doc: dict[str, Any] = {"max_tokens": args.max_tokens, "prompt_words": args.prompt_words, "model": args.model,
                           "bursts": {}}
    words, first = args.prompt_words, 0
    with aflex_up(args.model) as mesh:
        model = mesh.served_model()
        asyncio.run(burst(mesh.base_url, model, [None] * 4, args.max_tokens, words, 10**6))  # warm: kernels
        for n in sizes:
            two: list[int | None] = [0 if k % 2 == 0 else args.low_priority for k in range(n)]
            baseline = asyncio.run(burst(mesh.base_url, model, [None] * n, args.max_tokens, words, first))
            classes = asyncio.run(burst(mesh.base_url, model, two, args.max_tokens, words, first + n))
            first += 2 * n
            doc["bursts"][str(n)] = {"one_class": baseline, "two_classes": classes}
            for name, res in (("one class", baseline), ("two classes", classes)):
                for cls, r in res.items():
                    t = r["ttft"]
                    print(f"{n:3d} at once, {name:11s} priority {cls:>4s}: TTFT p50 {t['p50_s']} s  p90 {t['p90_s']} s"
                          f"  max {t['max_s']} s  statuses {r['statuses']}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
