"""Multi-turn chat with and without prefix caching: TTFT and energy per token side by side (issue 27).

    python benchmarks/multi_turn.py --conversations 8 --turns 6 --json out/multi_turn.json

Starts `aflex up` (default model) twice, with `AFLEX_PREFIX_CACHING=0` and then `=1`, and replays the same
conversations on each: `conversations` chats at once, each `turns` turns long, every turn sent when the
previous answer is in, with a shared system prompt and the whole history (what a chat UI or an agent
sends). Greedy, `max_tokens` each, EOS ignored, so both runs compute the same tokens; the answers are
compared (`identical_answers`). Per run: TTFT of the first turn and of the later ones, the share of prompt
tokens served from cache (`usage.prompt_tokens_details.cached_tokens`), and the energy the requests were
charged (`usage.energy_j`) per token (prompt + output) and per output token. Energy is the workers' GPU
backend's: measured (NVML counter) under `nvml`/`nvml-readonly`, modelled (emulated GPU profile) under
`emulated`; the JSON says which (`gpu_backend`, read from the workers' telemetry).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import openai

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shared import subjects
from shared.messages import WorkerTelemetry, decode
from shared.transport import bus
from tools.launch import Mesh, aflex_up

SYSTEM = ("You are a careful assistant for a lighthouse keepers' guild. You answer questions about lamps, "
          "lenses, fog signals, tides, weather logs, supply boats, rescue drills and the history of the "
          "coast. Keep answers short and factual; when unsure, say so; cite the logbook where you can. "
          "Lighthouses on this coast: North Spit (1856, first-order Fresnel lens), Gull Rock (1871, "
          "second-order), Harbour Mole (1902, acetylene then electric), Cape Dun (1911, rotating "
          "optic, foghorn), and the Ness (1928, automated 1974). Supply boats sail on Tuesdays and Fridays "
          "when the swell is under two metres. Drills are monthly; the logbook records every lamp change.")
QUESTIONS = ["Which light is the oldest?", "How often do supply boats sail?", "What does a Fresnel lens do?",
             "When was the Ness automated?", "Which light has a foghorn?", "How are lamp changes recorded?",
             "What limits the supply boats?", "How often are drills held?", "What fuel did Harbour Mole use?",
             "Summarise the coast's lights in one line."]


async def conversation(client: openai.AsyncOpenAI, model: str, index: int, turns: int,
                       max_tokens: int) -> list[dict[str, Any]]:
    """One chat, turn after turn; per turn its TTFT, usage and answer."""
    messages: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
    out = []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"(chat {index}) {QUESTIONS[(index + turn) % len(QUESTIONS)]}"})
        start = time.perf_counter()
        ttft, text, usage = float("nan"), [], None
        stream = await client.chat.completions.create(  # type: ignore[call-overload]
            model=model, messages=messages, max_tokens=max_tokens, temperature=0.0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                if ttft != ttft:
                    ttft = time.perf_counter() - start
                text.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                usage = chunk.usage.model_dump()
        answer = "".join(text)
        messages.append({"role": "assistant", "content": answer})
        out.append({"turn": turn, "ttft_s": ttft, "usage": usage, "answer": answer})
    return out


async def gpu_backend(mesh: Mesh) -> str:
    """The workers' GPU backend, from their telemetry (what says whether energy is measured or modelled)."""
    nc = await bus.connect(f"nats://127.0.0.1:{mesh.nats_port}", "bench-multi-turn")
    seen: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def on_telemetry(msg: Any) -> None:
        if not seen.done() and ".telemetry.plan" not in msg.subject:
            with contextlib.suppress(Exception):  # another telemetry message: wait for a worker's
                seen.set_result(decode(WorkerTelemetry, msg.data).gpu_backend)
    await nc.subscribe(subjects.TELEMETRY_ALL, cb=on_telemetry)
    try:
        return await asyncio.wait_for(seen, 30)
    finally:
        await nc.close()


def summary(turns: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    def p(values: list[float], q: int) -> float | None:
        values = [v for v in values if v == v]
        if len(values) < 2:
            return round(values[0], 4) if values else None
        return round(statistics.quantiles(values, n=100, method="inclusive")[q - 1], 4)
    usages = [t["usage"] for t in turns]
    prompt = sum(u["prompt_tokens"] for u in usages)
    output = sum(u["completion_tokens"] for u in usages)
    cached = sum((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0 for u in usages)
    energies = [u.get("energy_j") for u in usages]
    energy = None if any(e is None for e in energies) else sum(energies)
    first = [t["ttft_s"] for t in turns if t["turn"] == 0]
    later = [t["ttft_s"] for t in turns if t["turn"] > 0]
    return {"requests": len(turns), "wall_s": round(wall_s, 2), "prompt_tokens": prompt, "output_tokens": output,
            "cached_tokens": cached, "cached_share": round(cached / prompt, 4) if prompt else None,
            "ttft_first_turn_p50_s": p(first, 50), "ttft_later_turns_p50_s": p(later, 50),
            "ttft_later_turns_p90_s": p(later, 90), "ttft_all_p50_s": p(first + later, 50),
            "energy_j": energy, "energy_per_token_j": energy / (prompt + output) if energy is not None else None,
            "energy_per_output_token_j": energy / output if energy is not None else None}


async def replay(mesh: Mesh, args: argparse.Namespace) -> tuple[dict[str, Any], list[list[dict[str, Any]]]]:
    model = mesh.served_model()
    async with openai.AsyncOpenAI(base_url=mesh.base_url, api_key="unused", max_retries=0, timeout=600) as client:
        await conversation(client, model, -1, 1, 4)  # warm: kernels, first-call costs (its prefix is no chat's)
        start = time.perf_counter()
        chats = await asyncio.gather(*(conversation(client, model, k, args.turns, args.max_tokens)
                                       for k in range(args.conversations)))
        wall_s = time.perf_counter() - start
    return summary([t for chat in chats for t in chat], wall_s), chats


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    runs: dict[str, Any] = {}
    answers: dict[str, list[list[str]]] = {}
    backend = "unknown"
    for name, flag in (("uncached", "0"), ("cached", "1")):
        with aflex_up(args.model, env_extra={"AFLEX_PREFIX_CACHING": flag}, open_nats=True) as mesh:
            backend = asyncio.run(gpu_backend(mesh))
            runs[name], chats = asyncio.run(replay(mesh, args))
        answers[name] = [[t["answer"] for t in chat] for chat in chats]
    cold, warm = runs["uncached"], runs["cached"]

    def ratio(key: str) -> float | None:
        return round(warm[key] / cold[key], 4) if warm.get(key) and cold.get(key) else None
    doc = {"model": args.model, "conversations": args.conversations, "turns": args.turns,
           "max_tokens": args.max_tokens, "gpu_backend": backend,
           "energy_source": "measured (NVML counter)" if backend.startswith("nvml") else "modelled (emulated GPU)",
           "accounting": "per request: the workers' energy for the passes it ran (usage.energy_j)",
           "identical_answers": answers["uncached"] == answers["cached"], "runs": runs,
           "cached_over_uncached": {k: ratio(k) for k in ("ttft_later_turns_p50_s", "ttft_all_p50_s", "energy_j",
                                                          "energy_per_token_j", "wall_s")}}
    for name, r in runs.items():
        print(f"{name:9s} cached share {r['cached_share']}  TTFT p50 first {r['ttft_first_turn_p50_s']} s, later "
              f"{r['ttft_later_turns_p50_s']} s (p90 {r['ttft_later_turns_p90_s']})  energy/token "
              f"{r['energy_per_token_j']} J  wall {r['wall_s']} s")
    print(f"cached/uncached: {doc['cached_over_uncached']}  identical answers: {doc['identical_answers']}  "
          f"energy {doc['energy_source']}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
