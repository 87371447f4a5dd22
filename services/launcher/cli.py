"""The `aflex` command: one entry point for every service and tool.

Subcommands are thin: they parse flags, build the real objects and run them, turning AFlex's
typed errors into one clear line on stderr and exit status 2 (never a traceback).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from shared.errors import AFlexError

if TYPE_CHECKING:
    from shared.settings import ServiceSettings


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

    from shared.engine import Engine
    from shared.errors import TokenizerError
    from shared.model.checkpoint import open_checkpoint
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


SERVICES = {  # subcommand -> (settings class name in shared.settings, help)
    "gateway": ("GatewaySettings", "the OpenAI-compatible HTTP API"),
    "scheduler": ("SchedulerSettings", "admission, batching, microbatches, routing, clocks"),
    "attention-worker": ("AttentionWorkerSettings", "the attention half and the KV cache"),
    "ffn-worker": ("FFNWorkerSettings", "the FFN half"),
}
# option strings scripts and docs already use, beside the generated --field-name
FLAG_ALIASES = {"gpu_backend": ("--gpu-control",), "merge_microbatches": ("--merge",)}


def _setup_logging(settings: ServiceSettings) -> None:
    import logging

    level = settings.log_level.upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _run_service(args: argparse.Namespace) -> int:
    import asyncio
    from collections.abc import Callable, Coroutine
    from typing import Any

    from pydantic import ValidationError

    from shared import settings as s
    from shared.settings_flags import from_flags

    entry: Callable[..., Coroutine[Any, Any, None]]
    if args.command.endswith("-worker"):
        from shared.openmp_spin import bound_openmp_spin

        bound_openmp_spin()  # before torch loads: the halves take turns on the same cores
    if args.command == "gateway":
        from services.gateway.app import serve as entry
    elif args.command == "scheduler":
        from services.scheduler.main import run as entry
    elif args.command == "attention-worker":
        from services.attention_worker.worker import run as entry
    else:
        from services.ffn_worker.worker import run as entry
    try:
        settings: s.ServiceSettings = from_flags(getattr(s, SERVICES[args.command][0]), args)
    except ValidationError as exc:  # a bad AFLEX_* value: say which, without a traceback
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise AFlexError(f"invalid settings: {problems}") from None
    _setup_logging(settings)
    threads = settings.torch_threads if isinstance(settings, s.WorkerSettings) else None
    if threads:
        # Workers sharing a machine's cores would otherwise each start a thread per core and thrash
        # when both halves compute at once (the ping-pong pipeline). Set on the thread that computes.
        import torch

        torch.set_num_threads(threads)
    asyncio.run(entry(settings))
    return 0


def _add_services(sub: argparse._SubParsersAction) -> None:
    """One subcommand per service, its flags generated from its settings class (shared/settings_flags.py)."""
    from shared import settings as s
    from shared.settings_flags import add_flags

    for command, (cls_name, help_text) in SERVICES.items():
        p = sub.add_parser(command, help=help_text)
        add_flags(p, getattr(s, cls_name), aliases=FLAG_ALIASES)
        p.set_defaults(func=_run_service)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aflex", description=__doc__.splitlines()[0] if __doc__ else None)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_services(sub)
    from loadgen.cli import add_bench_arguments, bench
    from loadgen.sim.cli import add_sim_arguments, sim
    from services.launcher.liveness import add_liveness_arguments, liveness
    from services.launcher.supervisor import add_up_arguments, up
    from services.launcher.top import add_top_arguments, top

    for name, help_text, add_arguments, run in (
            ("up", "the whole mesh: nats-server, scheduler, workers, gateway", add_up_arguments, up),
            ("top", "live view of the mesh's telemetry: clocks, power, energy per token", add_top_arguments, top),
            ("bench", "replay a trace or synthetic load against an OpenAI-compatible server", add_bench_arguments,
             bench),
            ("sim", "replay a trace against a modelled cluster: AFlex and the baselines", add_sim_arguments, sim),
            ("liveness", "exit 1 if the scheduler or a worker has published no telemetry for --wait seconds "
             "(the Kubernetes probe)", add_liveness_arguments, liveness)):
        p = sub.add_parser(name, help=help_text)
        add_arguments(p)
        p.set_defaults(func=run)
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
