"""`python -m loadgen` / `aflex bench`: replay a workload against an OpenAI-compatible server.

`add_bench_arguments(parser)` adds the flags, `bench(args)` runs and returns the exit status
(0 when at least one request completed). See loadgen/__init__.py for an overview.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
from datetime import datetime
from typing import Any

from loadgen import workloads
from loadgen.client import ClientConfig, Prompt, discover_model, prompt_tokens_of, run_requests
from loadgen.energy import EnergyResult, TelemetryRecorder, run_energy
from loadgen.metrics import RequestResult, calculate_metrics, parse_goodput, usage_energy
from loadgen.prompts import PromptError, id_prompts, text_prompts, usable_token_ids
from loadgen.report import print_summary, write_json, write_plots
from shared.errors import AFlexError


class BenchError(AFlexError):
    """Flags that do not fit together, or a server that cannot be benchmarked."""


def _rate(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return value


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    server = p.add_argument_group("server")
    server.add_argument("--base-url", default=os.environ.get("AFLEX_BENCH_URL", "http://127.0.0.1:8000/v1"),
                        help="the server's OpenAI API root (default %(default)s)")
    server.add_argument("--url", help="the server's address, e.g. http://127.0.0.1:8000: the API root is URL/v1 "
                                      "(overrides --base-url)")
    server.add_argument("--endpoint", choices=["completions", "chat"], default="completions",
                        help="/v1/completions (token-id prompts possible) or /v1/chat/completions")
    server.add_argument("--model", help="model id to send (default: the first of GET /v1/models)")
    server.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="sent as a Bearer token")
    server.add_argument("--tokenizer", help="HF directory, .gguf or 'default': exact token-id prompts; "
                        "without it prompts are text calibrated against the server")
    server.add_argument("--prompt-mode", choices=["auto", "ids", "text"], default="auto",
                        help="auto: ids with --tokenizer on completions, else text")
    server.add_argument("--plain-openai", action="store_true",
                        help="do not send ignore_eos/min_tokens (servers that reject vLLM's extensions)")
    server.add_argument("--extra-body", type=json.loads, default={}, help="JSON merged into every request body")
    server.add_argument("--temperature", type=float, default=0.0)
    server.add_argument("--request-timeout", type=float, default=600.0, metavar="S")
    server.add_argument("--nats", metavar="URL", help="read worker telemetry (energy, power, clocks) from this "
                        "NATS server, e.g. nats://127.0.0.1:4222")

    load = p.add_argument_group("workload")
    load.add_argument("--trace", help="conv, code (Azure LLM inference traces) or a CSV path")
    load.add_argument("--time-scale", type=_rate, default=1.0,
                      help="trace speed-up: arrival offsets are divided by it (default 1 = real time)")
    load.add_argument("--window", help="START:END seconds of the trace to replay, e.g. 600:900")
    load.add_argument("--rate", type=_rate, default=None,
                      help="requests/s with Poisson/gamma arrivals (replaces a trace's own); default inf")
    load.add_argument("--burstiness", type=_rate, default=1.0, help="gamma shape: 1 Poisson, <1 burstier")
    load.add_argument("--preset", choices=sorted(workloads.PRESETS),
                      help="input/output lengths: " + ", ".join(f"{k} {i}/{o}" for k, (i, o)
                                                                 in workloads.PRESETS.items()))
    load.add_argument("--input-len", type=_positive_int, help="prompt tokens (synthetic workloads)")
    load.add_argument("--output-len", type=_positive_int, help="output tokens (synthetic workloads)")
    load.add_argument("--max-input-len", type=_positive_int, help="clip trace prompt lengths")
    load.add_argument("--max-output-len", type=_positive_int, help="clip trace output lengths")
    load.add_argument("--num-prompts", type=_positive_int,
                      help="requests to send (default: every trace row in the window; 100 synthetic)")
    load.add_argument("--max-concurrency", type=_positive_int, help="requests in flight at most")
    load.add_argument("--seed", type=int, default=0)

    out = p.add_argument_group("results")
    out.add_argument("--goodput", nargs="+", metavar="METRIC:MS", help="SLOs, e.g. ttft:500 tpot:50 (e2el:MS)")
    out.add_argument("--metric-percentiles", default="99", help="comma-separated, e.g. 50,90,99")
    out.add_argument("--json", metavar="FILE", help="write the results (vLLM's field names plus ours)")
    out.add_argument("--save-detailed", action="store_true", help="per-request arrays in the JSON")
    out.add_argument("--plots", metavar="DIR", help="latency CDFs and throughput/power/clock timelines (matplotlib)")
    out.add_argument("--label", default="aflex-bench")
    out.add_argument("--no-progress", action="store_true")
    out.add_argument("--quiet", action="store_true", help="no summary table")


def build_workload(args: argparse.Namespace) -> list[workloads.RequestSpec]:
    if args.trace:
        if args.input_len or args.output_len or args.preset:
            raise BenchError("--trace gives the lengths: use --max-input-len/--max-output-len to clip them")
        rows = workloads.read_trace(workloads.resolve_trace(args.trace))
        specs = workloads.trace_workload(rows, window=workloads.parse_window(args.window), time_scale=args.time_scale,
                                         num_prompts=args.num_prompts, max_input_len=args.max_input_len,
                                         max_output_len=args.max_output_len)
        if args.rate is not None:
            specs = workloads.with_arrivals(specs, args.rate, args.burstiness, args.seed)
        return specs
    if args.window or args.time_scale != 1.0:
        raise BenchError("--window and --time-scale apply to --trace")
    input_len, output_len = workloads.PRESETS[args.preset or "qa"]
    input_len = args.input_len or input_len
    output_len = args.output_len or output_len
    rate = math.inf if args.rate is None else args.rate
    return workloads.synthetic_workload(args.num_prompts or 100, input_len, output_len, rate=rate,
                                        burstiness=args.burstiness, seed=args.seed)


async def build_prompts(args: argparse.Namespace, config: ClientConfig, specs: list[workloads.RequestSpec]
                        ) -> tuple[list[Prompt], str]:
    mode = args.prompt_mode
    if mode == "auto":
        mode = "ids" if args.tokenizer and config.endpoint == "completions" else "text"
    if mode == "ids":
        if not args.tokenizer:
            raise BenchError("--prompt-mode ids needs --tokenizer (the server's tokenizer)")
        if config.endpoint != "completions":
            raise BenchError("token-id prompts need --endpoint completions")
        ids = await asyncio.to_thread(usable_token_ids, args.tokenizer)
        return id_prompts(specs, ids, args.seed), "ids"

    async def count(text: str) -> int:
        return await prompt_tokens_of(config, text)

    prompts, shortest = await text_prompts(specs, count)
    if any(s.input_len < shortest for s in specs):
        print(f"loadgen: text prompts have at least {shortest} tokens here; shorter asked lengths are not exact",
              file=sys.stderr)
    return prompts, "text"


class _Progress:
    def __init__(self, total: int, enabled: bool) -> None:
        self.progress: Any = None
        self.failed = 0
        if not enabled:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.progress = Progress(TextColumn("requests"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("failed {task.fields[failed]}"), TimeElapsedColumn(),
                                 transient=False, redirect_stderr=False, redirect_stdout=False)
        self.task = self.progress.add_task("bench", total=total, failed=0)

    def __enter__(self) -> _Progress:
        if self.progress is not None:
            self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.progress is not None:
            self.progress.stop()

    def update(self, result: RequestResult) -> None:
        if self.progress is not None:
            self.failed += 0 if result.success else 1
            self.progress.update(self.task, advance=1, failed=self.failed)


async def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    """The whole benchmark; returns the result dict (also written/printed as asked)."""
    try:
        slos = parse_goodput(args.goodput)
        percentiles = [float(p) for p in str(args.metric_percentiles).split(",") if p.strip()]
    except ValueError as exc:
        raise BenchError(str(exc)) from None
    specs = build_workload(args)
    try:
        model = args.model or await discover_model(args.base_url, args.api_key)
    except Exception as exc:
        raise BenchError(f"cannot list models at {args.base_url}/models: {exc}") from None
    config = ClientConfig(base_url=args.base_url, model=model, endpoint=args.endpoint, api_key=args.api_key,
                          max_concurrency=args.max_concurrency, request_timeout_s=args.request_timeout,
                          temperature=args.temperature, force_length=not args.plain_openai,
                          extra_body=dict(args.extra_body or {}))
    try:
        prompts, prompt_mode = await build_prompts(args, config, specs)
    except (RuntimeError, OSError) as exc:
        raise PromptError(str(exc)) from None
    recorder = TelemetryRecorder(args.nats) if args.nats else None
    if recorder is not None:
        await recorder.start()
    with _Progress(len(specs), not args.no_progress) as progress:
        outcome = await run_requests(config, specs, prompts, on_done=progress.update)
    t_end = outcome.started_perf + outcome.duration_s
    energy = EnergyResult(None)
    if recorder is not None:
        await recorder.finish(t_end)
        energy = run_energy(recorder.samples, outcome.started_perf, t_end)
    metrics = calculate_metrics(outcome.results, outcome.duration_s, goodput_slos_ms=slos, percentiles=percentiles)
    usage_j = usage_energy(outcome.results)
    energy_j, source = (energy.energy_j, "telemetry") if energy.energy_j is not None else (usage_j, "usage")
    total_out = metrics["total_output_tokens"]
    rate = "inf" if args.rate is None and not args.trace else ("trace" if args.rate is None else args.rate)
    result: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": "openai-chat" if args.endpoint == "chat" else "openai",
        "backend": "openai-chat" if args.endpoint == "chat" else "openai",
        "label": args.label,
        "model_id": model,
        "tokenizer_id": args.tokenizer,
        "base_url": args.base_url,
        "num_prompts": len(specs),
        "request_rate": rate,
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "trace": args.trace,
        "time_scale": args.time_scale if args.trace else None,
        "window": args.window,
        "prompt_mode": prompt_mode,
        **metrics,
        "energy_j": energy_j if energy_j is not None else None,
        "energy_source": source if energy_j is not None else None,
        "energy_per_token_j": energy_j / total_out if energy_j is not None and total_out else None,
        "avg_power_w": energy.energy_j / outcome.duration_s if energy.energy_j is not None
        and outcome.duration_s > 0 else None,
        "telemetry_energy_j": energy.energy_j,
        "telemetry_energy_per_worker_j": energy.per_worker_j or None,
        "usage_energy_j": usage_j,
        "usage_energy_per_token_j": usage_j / total_out if usage_j is not None and total_out else None,
        "energy_notes": energy.notes,
        "errors_sample": sorted({r.error for r in outcome.results if r.error})[:5],
    }
    if args.save_detailed:
        rs = outcome.results
        result.update({
            "input_lens": [r.input_len for r in rs],
            "output_lens": [(r.output_tokens or r.chunks) if r.success else 0 for r in rs],
            "requested_output_lens": [r.output_len for r in rs],
            "prompt_tokens": [r.prompt_tokens for r in rs],
            "ttfts": [r.ttft for r in rs],
            "itls": [r.itl for r in rs],
            "e2els": [r.latency for r in rs],
            "start_times": [r.start_time for r in rs],
            "energies_j": [r.energy_j for r in rs],
            "generated_texts": [r.generated_text for r in rs],
            "errors": [r.error for r in rs],
        })
    if not args.quiet:
        print_summary(result)
    if args.json:
        write_json(result, args.json)
    if args.plots:
        written = write_plots(args.plots, outcome.results, recorder.samples if recorder else [], outcome.started_perf)
        if not args.quiet:
            print("plots: " + ", ".join(str(p) for p in written))
    return result


def bench(args: argparse.Namespace) -> int:
    if getattr(args, "url", None):
        root = args.url.rstrip("/")
        args.base_url = root if root.endswith("/v1") else f"{root}/v1"
    result = asyncio.run(run_bench(args))
    return 0 if result["completed"] > 0 else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m loadgen", description=(__doc__ or "").splitlines()[0])
    add_bench_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return bench(args)
    except AFlexError as exc:
        print(f"loadgen: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
