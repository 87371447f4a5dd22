"""Both halves in one process: continuous batching, microbatches, and the unsplit reference.

This is the reference path for the split mesh (the same `AttentionHalf.attend` /
`FFNHalf.forward` calls, in the same order a worker pair makes them), the engine behind
`aflex generate`, and the baseline the mesh is benchmarked against.

One `step()` is one iteration: sequences join (prefill, chunked to the token budget) and leave
(finished) between steps; the scheduled sequences are cut into `microbatches` groups that go
through the layers interleaved, attention(mb0, l), ffn(mb0, l), attention(mb1, l), ... as the
A/F ping-pong pipeline runs them on two workers.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from shared.errors import InvalidRequestError, KVCacheExhaustedError
from shared.model.attention import AttentionHalf, AttentionMeta, PagedKVStore, SequencePass
from shared.model.checkpoint import Checkpoint
from shared.model.config import ModelArgs
from shared.model.ffn import FFNHalf
from shared.model.finish_rule import finish_reason
from shared.model.kv_cache import BlockAllocator, BlockTables
from shared.model.sampling import SamplingParams, SequenceSampler, StopStringMatcher, sample_next_tokens
from shared.model.weights import load_attention_half, load_ffn_half
from shared.policy.iteration import WorkItem, form_iteration, split_microbatches
from shared.token_history import TokenHistory

if TYPE_CHECKING:
    from shared.model.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class Sequence(TokenHistory):
    """A request's whole state: enough to re-run it from scratch on another worker."""

    seq_id: str
    prompt_ids: list[int]
    params: SamplingParams
    sampler: SequenceSampler
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the cache
    finish_reason: str | None = None
    text: str = ""
    detokenizer: IncrementalDetokenizer | None = None
    stop_matcher: StopStringMatcher | None = None



@dataclass(frozen=True)
class TokenEvent:
    """What one step produced for one sequence."""

    seq_id: str
    token_id: int
    text_delta: str
    finish_reason: str | None


@dataclass(frozen=True)
class Completion:
    seq_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str


class Engine:
    def __init__(self, attention: AttentionHalf, ffn: FFNHalf, tokenizer: Tokenizer | None = None, *,
                 num_kv_blocks: int = 1024, block_size: int = 16, max_batch_tokens: int = 2048,
                 max_num_seqs: int = 256, microbatches: int = 1) -> None:
        self.args: ModelArgs = attention.args
        self.attention, self.ffn, self.tokenizer = attention, ffn, tokenizer
        weight = attention.embed_tokens.weight
        self.device, self.dtype = weight.device, weight.dtype
        self.block_tables = BlockTables(BlockAllocator(num_kv_blocks, block_size))
        self.kv = PagedKVStore(self.args, num_kv_blocks * block_size, self.dtype, self.device)
        self.max_batch_tokens, self.max_num_seqs, self.microbatches = max_batch_tokens, max_num_seqs, microbatches
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.eos_token_ids = tokenizer.eos_token_ids if tokenizer else self.args.eos_token_ids
        self.num_preemptions = 0

    @classmethod
    def from_checkpoint(cls, checkpoint: Checkpoint, dtype: torch.dtype = torch.float32,
                        device: str = "cpu", quantize: str = "none", **kwargs: int) -> Engine:
        """Both halves from a checkpoint; `quantize="int8"` runs their projections W8A8 (see quant.py)."""
        attention = load_attention_half(checkpoint.args, checkpoint.tensors, dtype, device, quantize)
        ffn = load_ffn_half(checkpoint.args, checkpoint.tensors, dtype, device, quantize)
        assert isinstance(attention, AttentionHalf) and isinstance(ffn, FFNHalf)
        return cls(attention, ffn, checkpoint.tokenizer, **kwargs)

    # -- requests -------------------------------------------------------------------------------

    def add_request(self, seq_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        params.validate()
        if not prompt_ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        if any(not 0 <= t < self.args.vocab_size for t in prompt_ids):
            raise InvalidRequestError(f"prompt token ids must lie in [0, {self.args.vocab_size})",
                                      param="prompt")
        total = len(prompt_ids) + params.max_tokens
        capacity = self.block_tables.allocator.num_blocks * self.block_tables.block_size
        limit = min(self.args.max_seq_len, capacity)
        if total > limit:
            raise InvalidRequestError(
                f"prompt ({len(prompt_ids)} tokens) plus max_tokens ({params.max_tokens}) is {total} tokens, "
                f"more than this model's context of {limit} tokens", param="max_tokens")
        seq = Sequence(seq_id, list(prompt_ids), params, SequenceSampler(params, self.eos_token_ids))
        seq.sampler.saw(prompt_ids)
        if self.tokenizer is not None:
            from shared.model.tokenizer import IncrementalDetokenizer

            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_ids)
            seq.stop_matcher = StopStringMatcher(params.stop) if params.stop else None
        self.waiting.append(seq)

    def abort(self, seq_id: str) -> None:
        for seq in [*self.running, *self.waiting]:
            if seq.seq_id == seq_id:
                self._release(seq)
                if seq in self.running:
                    self.running.remove(seq)
                else:
                    self.waiting.remove(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- scheduling -----------------------------------------------------------------------------

    def _release(self, seq: Sequence) -> None:
        if self.block_tables.has_sequence(seq.seq_id):
            self.block_tables.free_sequence(seq.seq_id)
        seq.num_computed = 0

    def _preempt(self) -> None:
        """Free the newest running sequence's KV; it recomputes from its tokens when readmitted."""
        victim = self.running.pop()
        self.num_preemptions += 1
        self._release(victim)
        self.waiting.appendleft(victim)

    def _schedule(self) -> list[tuple[Sequence, int]]:
        """Pick (sequence, tokens to feed) for this step and reserve their KV slots.

        The step is `form_iteration`'s first-come first-served form (running sequences in order,
        then waiting ones), applied in order: a running sequence whose KV cannot grow preempts the
        newest running one and the step is formed again (what comes before it is unchanged, and
        its reservations stand); a waiting one that does not fit ends admission there.
        """
        while True:
            queue = [*(_item(s, False) for s in self.running), *(_item(s, True) for s in self.waiting)]
            form = form_iteration((), queue, token_budget=self.max_batch_tokens, max_num_seqs=self.max_num_seqs,
                                  running_count=len(self.running))
            scheduled: list[tuple[Sequence, int]] = []
            for feed in form.feeds:
                seq, n_new = feed.key, feed.n_tokens
                if feed.item.is_waiting and not self.block_tables.has_sequence(seq.seq_id):
                    self.block_tables.add_sequence(seq.seq_id)
                try:
                    self.block_tables.reserve(seq.seq_id, seq.num_computed + n_new)
                except KVCacheExhaustedError:
                    if feed.item.is_waiting:
                        if not self.running and not scheduled:
                            raise
                        return scheduled
                    if len(self.running) == 1 and not scheduled:
                        raise
                    self._preempt()
                    break
                if feed.item.is_waiting:
                    assert self.waiting[0] is seq  # FCFS admits a prefix of the waiting queue
                    self.waiting.popleft()
                    self.running.append(seq)
                scheduled.append((seq, n_new))
            else:
                return scheduled

    # -- the forward pass -----------------------------------------------------------------------

    @torch.inference_mode()
    def _run(self, scheduled: list[tuple[Sequence, int]]) -> Tensor:
        """Feed every scheduled sequence its tokens; returns logits [B', V] of those that sample."""
        passes, token_ids = [], []
        for seq, n_new in scheduled:
            start = seq.num_computed
            ids = seq.all_ids
            token_ids.append(ids[start:start + n_new])
            passes.append(SequencePass(start, n_new, self.block_tables.slots(seq.seq_id, 0, start + n_new),
                                       wants_logits=start + n_new == len(ids)))
        logits: list[Tensor] = []
        groups = split_microbatches([p.n_new for p in passes], self.microbatches)
        states = []
        for group in groups:
            meta = AttentionMeta.build([passes[i] for i in group], self.device)
            tokens = torch.tensor([t for i in group for t in token_ids[i]], device=self.device)
            states.append((meta, self.attention.rope(meta.positions), self.attention.embed(tokens), None))
        for layer in range(self.args.n_layers):
            for index, (meta, rope, residual, ffn_out) in enumerate(states):
                residual, ffn_in = self.attention.attend(layer, residual, ffn_out, rope, meta, self.kv)
                states[index] = (meta, rope, residual, self.ffn(layer, ffn_in))
        for meta, _, residual, ffn_out in states:
            assert ffn_out is not None  # every model has at least one layer
            logits.append(self.attention.logits(residual, ffn_out, meta.logits_rows))
        return torch.cat(logits)

    def step(self) -> list[TokenEvent]:
        scheduled = self._schedule()
        if not scheduled:
            return []
        logits = self._run(scheduled)
        sampling: list[Sequence] = []
        for seq, n_new in scheduled:
            seq.num_computed += n_new
            if seq.num_computed == seq.num_tokens:
                sampling.append(seq)
        token_ids = sample_next_tokens(logits, [s.sampler for s in sampling])
        events = [self._append(seq, token) for seq, token in zip(sampling, token_ids, strict=True)]
        for seq in sampling:
            if seq.finish_reason is not None:
                self.running.remove(seq)
                self._release(seq)
        return events

    def _append(self, seq: Sequence, token_id: int) -> TokenEvent:
        seq.finish_reason = _finish_reason(seq, token_id)
        seq.output_ids.append(token_id)
        seq.sampler.record(token_id)
        delta = ""
        if seq.detokenizer is not None:
            delta = seq.detokenizer.push(token_id)
            if seq.finish_reason is not None:
                delta += seq.detokenizer.flush()
            if seq.stop_matcher is not None:
                delta, hit = seq.stop_matcher.feed(delta)
                if hit:
                    seq.finish_reason = "stop"
                elif seq.finish_reason is not None:
                    delta += seq.stop_matcher.flush()
            seq.text += delta
        return TokenEvent(seq.seq_id, token_id, delta, seq.finish_reason)

    # -- convenience ----------------------------------------------------------------------------

    def generate(self, prompts: Iterable[list[int]], params: SamplingParams | list[SamplingParams]
                 ) -> list[Completion]:
        """Run prompts to completion with continuous batching; results in prompt order."""
        prompts = list(prompts)
        param_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"gen-{i}" for i in range(len(prompts))]
        sequences: dict[str, Sequence] = {}
        for seq_id, prompt, p in zip(ids, prompts, param_list, strict=True):
            self.add_request(seq_id, prompt, p)
            sequences[seq_id] = self.waiting[-1]
        while self.has_unfinished():
            self.step()
        return [Completion(s.seq_id, s.prompt_ids, s.output_ids, s.text, s.finish_reason or "stop")
                for s in (sequences[i] for i in ids)]


def _finish_reason(seq: Sequence, token_id: int) -> str | None:
    """Why `seq` ends if `token_id` is appended now (call before appending): the finish rule, decided here as
    the scheduler decides it in the mesh (no worker's sampler decides it), over the tokens generated so far."""
    return finish_reason(seq.params, len(seq.output_ids), token_id, seq.sampler.eos_token_ids,
                         constrained=seq.sampler.constraint is not None)


def _item(seq: Sequence, waiting: bool) -> WorkItem[Sequence]:
    return WorkItem(seq, seq.pending_tokens, is_waiting=waiting)


@torch.inference_mode()
def forward_unsplit(attention: AttentionHalf, ffn: FFNHalf, token_ids: list[int]) -> Tensor:
    """The textbook forward of one whole sequence, no cache, no seam: logits [S, V].

    The reference the split engine is checked against: each layer is
    h = x + attn(norm(x)); x = h + ffn(norm(h)).
    """
    tokens = torch.tensor(token_ids, device=attention.embed_tokens.weight.device)
    cos, sin = attention.rope(torch.arange(len(token_ids), device=tokens.device))
    x = attention.embed(tokens)
    for layer in range(attention.args.n_layers):
        block = attention.block(layer)
        h = x + block.self_attn.forward_contiguous(block.input_layernorm(x), cos, sin)
        x = h + ffn(layer, block.post_attention_layernorm(h))
    return attention.project_logits(attention.norm(x))
