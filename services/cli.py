"""The `aflex` command: one entry point for every service and tool.

Subcommands are thin: they parse flags, build the real objects and run them, turning AFlex's
typed errors into one clear line on stderr and exit status 2 (never a traceback).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from shared.errors import AFlexError


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="run the in-process engine (both halves) on one prompt")
    p.add_argument("--model", default="default", help="HF directory, .gguf file, or 'default' (SmolLM2)")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text")
    prompt.add_argument("--prompt-ids", type=_parse_ids, help="prompt as token ids: 1,2,3")
    p.add_argument("--chat", action="store_true", help="wrap --prompt as a user message in the chat template")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--min-tokens", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--quantize", default="none", choices=["none", "int8"],
                   help="int8: W8A8 projections on the CPU (faster, close to but not equal to float32)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", action="store_true", help="print one JSON object: token_ids and text")
    p.set_defaults(func=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    import orjson
    import torch

    from shared.errors import TokenizerError
    from shared.model.checkpoint import open_checkpoint
    from shared.model.engine import Engine
    from shared.model.sampling import SamplingParams

    checkpoint = open_checkpoint(args.model)
    tokenizer = checkpoint.tokenizer
    if args.prompt is not None:
        if tokenizer is None:
            raise TokenizerError(f"{checkpoint.path} has no tokenizer: give --prompt-ids instead of --prompt")
        if args.chat:
            text = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
            prompt_ids = tokenizer.encode(text)
        else:
            prompt_ids = tokenizer.encode(args.prompt, add_special_tokens=True)
    else:
        if args.chat:
            raise AFlexError("--chat applies to --prompt text, not to --prompt-ids")
        prompt_ids = args.prompt_ids
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                            max_tokens=args.max_tokens, min_tokens=args.min_tokens, stop=tuple(args.stop),
                            ignore_eos=args.ignore_eos)
    engine = Engine.from_checkpoint(checkpoint, dtype=getattr(torch, args.dtype), device=args.device,
                                    quantize=args.quantize)
    completion = engine.generate([prompt_ids], params)[0]
    if args.json:
        sys.stdout.write(orjson.dumps({
            "token_ids": completion.token_ids,
            "text": completion.text,
            "finish_reason": completion.finish_reason,
            "prompt_tokens": len(prompt_ids),
        }).decode() + "\n")
    else:
        print(completion.text)
    return 0


def _common_service_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nats-url", help="NATS server URL (env AFLEX_NATS_URL)")
    p.add_argument("--log-level", help="DEBUG, INFO, WARNING (env AFLEX_LOG_LEVEL)")


def _worker_flags(p: argparse.ArgumentParser) -> None:
    _common_service_flags(p)
    p.add_argument("--worker-id", help="unique id; becomes a NATS subject token")
    p.add_argument("--model", help="HF directory, .gguf file, or 'default' (env AFLEX_MODEL)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--quantize", choices=["none", "int8"],
                   help="int8: W8A8 projections on the CPU (env AFLEX_QUANTIZE; default none)")
    p.add_argument("--device", help="torch device, e.g. cpu or cuda:0")
    p.add_argument("--gpu-control", dest="gpu_backend", choices=["auto", "nvml", "nvml-readonly", "emulated"],
                   help="GPU backend: auto = nvml-readonly where NVML works, else emulated; nvml sets clocks "
                        "(needs root or CAP_SYS_ADMIN) (env AFLEX_GPU_BACKEND)")
    p.add_argument("--gpu-profile", help="emulated GPU profile: a800, a100, h100, h200, b200")
    p.add_argument("--gpu-pace", action="store_true", default=None,
                   help="emulated GPU: pace work to the modelled time, so a lower clock really slows the worker")
    p.add_argument("--telemetry-hz", type=float, help="telemetry messages per second (default 10)")
    p.add_argument("--torch-threads", type=int, help="CPU threads for torch (default: torch's own choice)")
    p.add_argument("--seam-transport", choices=["lean", "nats-py"],
                   help="seam frames on the worker's lean NATS link (default) or its nats-py connection "
                        "(for TLS or NKey/JWT servers) (env AFLEX_SEAM_TRANSPORT)")


def _settings(cls: type, args: argparse.Namespace, fields: tuple[str, ...]) -> object:
    """Settings from the flags that were given; the rest from AFLEX_* env, then defaults."""
    given = {name: getattr(args, name) for name in fields if getattr(args, name, None) is not None}
    return cls(**given)


def _setup_logging(settings: object) -> None:
    import logging

    level = str(getattr(settings, "log_level", "INFO")).upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _run_service(args: argparse.Namespace) -> int:
    import asyncio
    from collections.abc import Callable, Coroutine
    from typing import Any

    from shared import settings as s

    entry: Callable[..., Coroutine[Any, Any, None]]
    common = ("nats_url", "log_level")
    worker = (*common, "worker_id", "model", "dtype", "quantize", "device", "gpu_backend", "gpu_profile", "gpu_pace",
              "telemetry_hz", "torch_threads", "seam_transport")
    settings: Any
    if args.command == "gateway":
        from services.gateway.app import serve

        entry = serve
        settings = _settings(s.GatewaySettings, args, (*common, "host", "port", "model", "served_model_name",
                                                       "api_key"))
    elif args.command == "scheduler":
        from services.scheduler.service import run as run_scheduler

        entry = run_scheduler
        settings = _settings(s.SchedulerSettings, args, (*common, "model", "max_queue", "max_batch_tokens",
                                                         "max_num_seqs", "microbatch_depth", "batching",
                                                         "freq_policy", "fixed_clocks", "ttft_slo_ms", "tpot_slo_ms"))
    elif args.command == "attention-worker":
        from services.attention_worker.worker import run as run_attention

        entry = run_attention
        settings = _settings(s.AttentionWorkerSettings, args, (*worker, "num_kv_blocks", "block_size"))
    else:
        from services.ffn_worker.worker import run as run_ffn

        entry = run_ffn
        settings = _settings(s.FFNWorkerSettings, args, (*worker, "merge_microbatches"))
    _setup_logging(settings)
    threads = getattr(settings, "torch_threads", None)
    if threads:
        # Workers sharing a machine's cores would otherwise each start a thread per core and thrash
        # when both halves compute at once (the ping-pong pipeline). Set on the thread that computes.
        import torch

        torch.set_num_threads(threads)
    asyncio.run(entry(settings))
    return 0


def _add_services(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("gateway", help="the OpenAI-compatible HTTP API")
    _common_service_flags(p)
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--model", help="whose tokenizer and id the gateway serves (env AFLEX_MODEL)")
    p.add_argument("--served-model-name", help="the model id clients send (default: the checkpoint's)")
    p.add_argument("--api-key", help="require `Authorization: Bearer KEY` (env AFLEX_API_KEY)")
    p.set_defaults(func=_run_service)

    p = sub.add_parser("scheduler", help="admission, batching, microbatches, routing")
    _common_service_flags(p)
    p.add_argument("--model", help="the model served (env AFLEX_MODEL): its context and EOS ids")
    p.add_argument("--max-queue", type=int, help="waiting requests before 429")
    p.add_argument("--max-batch-tokens", type=int, help="tokens per iteration per attention worker")
    p.add_argument("--max-num-seqs", type=int, help="running sequences per attention worker")
    p.add_argument("--microbatch-depth", choices=["auto", "1", "2", "3", "4"])
    p.add_argument("--batching", choices=["aflex", "fcfs"],
                   help="prefill order and cap: aflex (shortest first with aging, SLO-capped; the default) or fcfs")
    p.add_argument("--freq-policy", choices=["aflex", "slo", "max", "fixed"],
                   help="how the scheduler picks worker clocks (default aflex; env AFLEX_FREQ_POLICY)")
    p.add_argument("--fixed-clocks", help="for --freq-policy fixed: e.g. attention.decode=900,ffn=1200")
    p.add_argument("--ttft-slo-ms", type=float, help="P90 time-to-first-token SLO (default 400)")
    p.add_argument("--tpot-slo-ms", type=float, help="P90 time-per-output-token SLO (default 120)")
    p.set_defaults(func=_run_service)

    p = sub.add_parser("attention-worker", help="the attention half and the KV cache")
    _worker_flags(p)
    p.add_argument("--num-kv-blocks", type=int)
    p.add_argument("--block-size", type=int)
    p.set_defaults(func=_run_service)

    p = sub.add_parser("ffn-worker", help="the FFN half")
    _worker_flags(p)
    p.add_argument("--no-merge", dest="merge_microbatches", action="store_false", default=None,
                   help="serve queued microbatches one by one instead of stacking them")
    p.set_defaults(func=_run_service)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aflex", description=__doc__.splitlines()[0] if __doc__ else None)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_services(sub)
    from services.supervisor import add_up_arguments, up
    from tools.top import add_top_arguments, top

    p = sub.add_parser("up", help="the whole mesh: nats-server, scheduler, workers, gateway")
    add_up_arguments(p)
    p.set_defaults(func=up)
    p = sub.add_parser("top", help="live view of the mesh's telemetry: clocks, power, energy per token")
    add_top_arguments(p)
    p.set_defaults(func=top)
    from loadgen.cli import add_bench_arguments, bench
    from loadgen.sim.cli import add_sim_arguments, sim

    p = sub.add_parser("bench", help="replay a trace or synthetic load against an OpenAI-compatible server")
    add_bench_arguments(p)
    p.set_defaults(func=bench)
    p = sub.add_parser("sim", help="replay a trace against a modelled cluster: AFlex and the baselines")
    add_sim_arguments(p)
    p.set_defaults(func=sim)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except AFlexError as exc:
        print(f"aflex {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
