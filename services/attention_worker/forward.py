"""One microbatch's pass through the attention half, and what it commits to its sequences.

Embed, every layer's attention with an FFN round trip (`ffn_hops.py`; a colocated worker's own FFN
half, `local_ffn.py`), then logits, sampling and logprobs. Each attention layer and the lm_head run
at the phase's clock and are accounted on the GPU (modelled time, energy); the FFN replies bring the
energy of their share of each forward. The seconds and joules add up in the microbatch's
`MicrobatchTiming`.
"""

from __future__ import annotations

import functools
import logging
import time

import torch
from torch import Tensor

from services.attention_worker.done_report import MicrobatchTiming
from services.attention_worker.follower import ATTEND, END, PASS, pass_args
from services.attention_worker.local_ffn import FFNPath, LocalFFN
from services.attention_worker.logprob_rows import PromptPart, prompt_parts, sampled_logprobs
from services.attention_worker.sequences import Admitted
from services.worker_base.gpu import WorkerGPU
from services.worker_base.rank_group import clock_state
from shared.gpu.base import OperatorWork
from shared.gpu.workload import attention_work, lm_head_work
from shared.kinds import ClockPhase, clock_phase
from shared.messages import MicrobatchDescriptor, SeqResult, TokenLogprob
from shared.model.attention import AttentionHalf, AttentionMeta, PagedKVStore
from shared.model.sampling import sample_next_tokens
from shared.transport.device_group import DeviceGroup, leading

log = logging.getLogger("aflex.attention_worker")


async def forward(model: AttentionHalf, kv: PagedKVStore, worker_gpu: WorkerGPU, hops: FFNPath,
                  desc: MicrobatchDescriptor, admitted: list[Admitted], timing: MicrobatchTiming,
                  group: DeviceGroup | None = None, block_size: int = 0
                  ) -> tuple[list[int], list[TokenLogprob | None], dict[int, PromptPart]]:
    """The sampled tokens and their logprobs (of the sequences that sample, in order), and the echoed
    prompts' logprob parts by index into `admitted`. Rank 0 of a `group` tells its followers each step
    first (follower.py); their energy joins the microbatch's at the end."""
    if group is None:
        return await _forward(model, kv, worker_gpu, hops, desc, admitted, timing, None)
    with group.lock:
        group.send(PASS, mb_id=desc.mb_id, phase=clock_phase(desc.phase), clock=clock_state(worker_gpu),
                   **pass_args(admitted, block_size))
    try:
        return await _forward(model, kv, worker_gpu, hops, desc, admitted, timing, group)
    finally:
        if not group.broken:
            with group.step(END, mb_id=desc.mb_id):
                attention_j, ffn_j = group.sum_floats([0.0, 0.0])
            timing.attention_energy_j += attention_j
            timing.ffn_energy_j += ffn_j


async def _forward(model: AttentionHalf, kv: PagedKVStore, worker_gpu: WorkerGPU, hops: FFNPath,
                   desc: MicrobatchDescriptor, admitted: list[Admitted], timing: MicrobatchTiming,
                   group: DeviceGroup | None) -> tuple[list[int], list[TokenLogprob | None], dict[int, PromptPart]]:
    gpu, controller, meter = worker_gpu.gpu, worker_gpu.controller, worker_gpu.meter
    phase = clock_phase(desc.phase)
    device = model.embed_tokens.weight.device
    dtype_bytes = model.weight_bytes
    local = isinstance(hops, LocalFFN)  # a group's followers then hold each layer's FFN output themselves
    t = time.perf_counter()
    with torch.inference_mode():
        meta = AttentionMeta.build([a.seq_pass for a in admitted], device)
        token_ids = torch.tensor([tok for a in admitted for tok in a.work.token_ids], device=device)
        rope = model.rope(meta.positions)
        residual = model.embed(token_ids)
    timing.attention_s += time.perf_counter() - t
    layer_work = attention_work(model.args, meta.n_tokens, [a.end for a in admitted], dtype_bytes=dtype_bytes)
    ffn_out: Tensor | None = None
    block = phase == "decode"  # short waits: on the loop's thread (see the torch seam)
    for layer in range(model.args.n_layers):
        controller.before_microbatch(phase)
        energy0 = gpu.total_energy_j()
        t = time.perf_counter()
        sent = [] if ffn_out is None or local else [ffn_out]
        with torch.inference_mode(), leading(group, ATTEND, sent, mb_id=desc.mb_id, layer=layer):
            residual, ffn_in = model.attend(layer, residual, ffn_out, rope, meta, kv)
        attend_s = time.perf_counter() - t
        t = time.perf_counter()
        # the layer's accounting runs once ffn_in is on its way, while the FFN works
        account = functools.partial(_account_attention, worker_gpu, phase, layer_work, attend_s, energy0, timing)
        ffn_out, ffn_energy, ffn_compute_s = await hops.round_trip(desc, layer, ffn_in, account, block=block)
        wait_s = time.perf_counter() - t
        timing.attention_s += attend_s
        timing.ffn_wait_s += wait_s
        timing.ffn_compute_s += ffn_compute_s
        timing.ffn_energy_j += ffn_energy
        log.debug("mb %s layer %d: attention %.2f ms, ffn wait %.2f ms (%d rows)",
                  desc.mb_id, layer, attend_s * 1e3, wait_s * 1e3, meta.n_tokens)
    assert ffn_out is not None
    controller.before_microbatch(phase)
    energy0 = gpu.total_energy_j()
    t = time.perf_counter()
    with torch.inference_mode():
        samplers = [a.state.sampler for a in admitted if a.work.sample]
        tokens: list[int] = []
        logprobs: list[TokenLogprob | None] = []
        if samplers:
            logits = model.logits(residual, ffn_out, meta.logits_rows)
            tokens = sample_next_tokens(logits, samplers)
            logprobs = sampled_logprobs(logits, samplers, tokens)
        prompt = prompt_parts(model, residual, ffn_out, admitted)
    logits_s = time.perf_counter() - t
    if samplers:
        meter.busy(logits_s, gpu.run(lm_head_work(model.args, len(samplers), dtype_bytes=dtype_bytes), logits_s))
    timing.attention_energy_j += gpu.total_energy_j() - energy0
    timing.attention_s += logits_s
    return tokens, logprobs, prompt


def _account_attention(worker_gpu: WorkerGPU, phase: ClockPhase, work: OperatorWork, attend_s: float,
                       energy0_j: float, timing: MicrobatchTiming) -> None:
    """One layer's attention on the GPU's books: modelled time, meter, the microbatch's attention energy."""
    gpu = worker_gpu.gpu
    worker_gpu.meter.op(phase, attend_s, gpu.run(work, attend_s))
    timing.attention_energy_j += gpu.total_energy_j() - energy0_j


def commit(admitted: list[Admitted], tokens: list[int], logprobs: list[TokenLogprob | None],
           prompt: dict[int, PromptPart]) -> list[SeqResult]:
    """Advance the sequences' computed counts and record the sampled tokens in their samplers (penalties,
    `min_tokens`, the grammar); whether a token ends its request is the scheduler's to decide (finish_rule.py)."""
    results = []
    sampled = iter(zip(tokens, logprobs, strict=True))
    for index, item in enumerate(admitted):
        item.state.num_computed = item.end
        token: int | None = None
        logprob: TokenLogprob | None = None
        if item.work.sample:
            token, logprob = next(sampled)
            item.state.sampler.record(token)
        part = prompt.get(index)
        if part is not None:
            item.state.held = part.held
        results.append(SeqResult(seq_id=item.work.seq_id, token_id=token, logprob=logprob,
                                 prompt_logprobs=part.entries if part else [],
                                 prompt_logprobs_start=part.start if part else 0))
    return results
