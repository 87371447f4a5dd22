"""The attention worker's per-sequence state: KV block tables, computed-token counts, samplers.

The scheduler owns a request's whole state; the worker keeps only what it must to continue a
sequence across microbatches: where its K/V live, how many tokens of it are in the cache (so a
descriptor whose `start_pos` disagrees is refused instead of silently attending to garbage), and
its sampler (its RNG stream and the token counts that penalties and `min_tokens` use).

Prefix caching: every full block whose K/V a committed pass wrote is named by its content
(`shared.model.block_hash`, chained from the sequence's first token), so it stays cached when the
sequence ends; a first pass that names cached blocks (`SeqWork.prefix`) starts from them, or is refused
(`prefix_missing`) when one was evicted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor

from shared.error_types import PREFIX_MISSING, ErrorType
from shared.errors import AFlexError, KVCacheExhaustedError
from shared.messages import SeqWork
from shared.model.attention import SequencePass
from shared.model.block_hash import name_new_blocks
from shared.model.kv_cache import BlockTables
from shared.model.sampling import SequenceSampler
from shared.model.structured import Constraint, llg_tokenizer
from shared.model.tokenizer import Tokenizer


class SequenceRefused(AFlexError):
    """One sequence of a microbatch cannot run; `code` says why (the others still run)."""

    def __init__(self, code: str, message: str, error_type: ErrorType) -> None:
        super().__init__(message)
        self.code, self.error_type = code, error_type


@dataclass
class SequenceState:
    sampler: SequenceSampler
    num_computed: int = 0  # tokens whose K/V are in this worker's cache
    held: Tensor | None = None  # prompt logprobs: the last chunk's last row ([1, V]) until its target comes
    # prefix caching: the name of its last named block, how many are named, and the tokens fed since
    # (None: not named, as for a fork or a handed-off KV, whose first tokens this worker never saw)
    last_name: int | None = None
    named_blocks: int = 0
    unnamed: list[int] | None = field(default_factory=list)


@dataclass(frozen=True)
class Admitted:
    """A sequence accepted into a microbatch: its pass, and where its K/V will end."""

    work: SeqWork
    state: SequenceState
    seq_pass: SequencePass
    is_new: bool
    copies: list[tuple[int, int]]  # (source, destination) KV blocks to copy before the pass writes

    @property
    def end(self) -> int:
        return self.work.start_pos + len(self.work.token_ids)


class SequenceTable:
    def __init__(self, block_tables: BlockTables, eos_token_ids: tuple[int, ...], vocab_size: int,
                 max_seq_len: int, tokenizer: Tokenizer | None = None) -> None:
        self.block_tables = block_tables
        self.tokenizer = tokenizer  # for structured outputs' grammars (None: a checkpoint without one)
        if tokenizer is not None:  # built now (the worker loads off its event loop), not at the first grammar
            llg_tokenizer(tokenizer, vocab_size)
        self.eos_token_ids, self.vocab_size, self.max_seq_len = eos_token_ids, vocab_size, max_seq_len
        self._states: dict[str, SequenceState] = {}

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self._states

    def __len__(self) -> int:
        return len(self._states)

    @property
    def free_blocks(self) -> int:
        return self.block_tables.allocator.num_free_blocks

    @property
    def total_blocks(self) -> int:
        return self.block_tables.allocator.num_blocks

    def num_computed(self, seq_id: str) -> int:
        state = self._states.get(seq_id)
        return 0 if state is None else state.num_computed

    def admit(self, work: SeqWork) -> Admitted:
        """Check `work` against this worker's state and reserve its KV; raises `SequenceRefused`.

        Atomic: a refused sequence leaves no trace (a new one is forgotten, an old one unchanged).
        """
        n_new = len(work.token_ids)
        if n_new == 0:
            raise SequenceRefused("invalid_tokens", f"sequence {work.seq_id}: no token ids to feed",
                                  ErrorType.INVALID_REQUEST)
        if any(not 0 <= t < self.vocab_size for t in work.token_ids):
            raise SequenceRefused("invalid_tokens", f"sequence {work.seq_id}: token ids must lie in "
                                  f"[0, {self.vocab_size})", ErrorType.INVALID_REQUEST)
        end = work.start_pos + n_new
        if end > self.max_seq_len:
            raise SequenceRefused("context_length_exceeded", f"sequence {work.seq_id}: {end} tokens exceed "
                                  f"the model's context of {self.max_seq_len}", ErrorType.INVALID_REQUEST)
        state = self._states.get(work.seq_id)
        is_new = state is None
        parent = self._states.get(work.fork_of) if is_new and work.fork_of is not None else None
        if is_new and work.fork_of is not None and (parent is None or parent.num_computed < work.start_pos):
            raise SequenceRefused("fork_parent_missing", f"sequence {work.seq_id}: its first {work.start_pos} "
                                  f"tokens were to be shared with {work.fork_of}, which this worker does not "
                                  "hold that far (resend it from start_pos 0)", ErrorType.SERVER_ERROR)
        if state is None:
            if work.start_pos != 0 and parent is None and not work.prefix:
                raise SequenceRefused("start_pos_mismatch", f"sequence {work.seq_id}: start_pos is "
                                      f"{work.start_pos} but this worker holds no KV for it (resend it from "
                                      "start_pos 0 with its sampling and generated_ids)", ErrorType.SERVER_ERROR)
            state = self._new_state(work)
            state.num_computed = work.start_pos  # a fork's shared prefix (else 0)
        elif work.start_pos != state.num_computed:
            raise SequenceRefused("start_pos_mismatch", f"sequence {work.seq_id}: start_pos is {work.start_pos} "
                                  f"but this worker has computed {state.num_computed} of its tokens",
                                  ErrorType.SERVER_ERROR)
        if is_new and work.fork_of is not None:
            self.block_tables.fork(work.fork_of, work.seq_id, work.start_pos)
            state.unnamed = None
        elif is_new and work.prefix:
            self._take_prefix(work, state)
        elif is_new:
            self.block_tables.add_sequence(work.seq_id)
        try:
            self.block_tables.reserve(work.seq_id, end)
            copies = self.block_tables.copy_on_write(work.seq_id, work.start_pos, end)
        except KVCacheExhaustedError as exc:
            if is_new:
                self.block_tables.free_sequence(work.seq_id)
            raise SequenceRefused("kv_cache_exhausted", f"sequence {work.seq_id}: {exc}",
                                  ErrorType.OVERLOADED) from None
        if is_new:
            self._states[work.seq_id] = state
        state.sampler.saw(work.token_ids)
        seq_pass = SequencePass(work.start_pos, n_new, self.block_tables.slots(work.seq_id, 0, end),
                                wants_logits=work.sample)
        return Admitted(work, state, seq_pass, is_new, copies)

    def _take_prefix(self, work: SeqWork, state: SequenceState) -> None:
        """A new sequence's first `start_pos` tokens from the cached blocks its pass names; refused (nothing
        kept) when the worker no longer holds them all."""
        assert work.prefix is not None
        bs = self.block_tables.block_size
        got = self.block_tables.add_cached_sequence(work.seq_id, work.prefix)
        if got != work.start_pos or len(work.prefix) * bs != work.start_pos:
            self.block_tables.free_sequence(work.seq_id)
            raise SequenceRefused(PREFIX_MISSING, f"sequence {work.seq_id}: {got} of the {work.start_pos} cached "
                                  "prefix tokens its first pass names are on this worker (resend it from start_pos "
                                  "0)", ErrorType.SERVER_ERROR)
        state.last_name, state.named_blocks = work.prefix[-1], len(work.prefix)

    def name_computed(self, admitted: list[Admitted]) -> None:
        """After a committed pass: name the sequences' newly full blocks, whose K/V are written now."""
        bs = self.block_tables.block_size
        for item in admitted:
            state, seq_id = item.state, item.work.seq_id
            if state.unnamed is None or not self.block_tables.has_sequence(seq_id):
                continue
            state.unnamed += item.work.token_ids
            names, used = name_new_blocks(state.unnamed, bs, state.last_name)
            if not names:
                continue
            self.block_tables.name_blocks(seq_id, names, first_block=state.named_blocks)
            state.last_name, state.named_blocks = names[-1], state.named_blocks + len(names)
            del state.unnamed[:used]

    def _new_state(self, work: SeqWork) -> SequenceState:
        """A sequence's first pass here: its sampler, from `sampling` and the tokens generated before."""
        if work.sampling is None:
            raise SequenceRefused("missing_sampling", f"sequence {work.seq_id}: its first pass on this "
                                  "worker must carry `sampling`", ErrorType.INVALID_REQUEST)
        try:
            work.sampling.validate()
        except AFlexError as exc:
            raise SequenceRefused("invalid_sampling", f"sequence {work.seq_id}: {exc}",
                                  ErrorType.INVALID_REQUEST) from None
        state = SequenceState(SequenceSampler(work.sampling, self.eos_token_ids, self._constraint(work)))
        for token_id in work.generated_ids:  # penalties and min_tokens see what came before
            state.sampler.record(token_id)
        return state

    def adopt(self, work: SeqWork) -> list[int]:
        """A sequence whose first `start_pos` tokens' KV another worker computed (a P/D handoff): its state and
        blocks, before `admit` takes the pass; returns the slots that KV goes into. Raises `SequenceRefused`
        (atomic: nothing is kept)."""
        if work.seq_id in self._states or self.block_tables.has_sequence(work.seq_id):
            raise SequenceRefused("kv_handoff_conflict", f"sequence {work.seq_id}: this worker already holds it, "
                                  "so the KV handed to it cannot be taken", ErrorType.SERVER_ERROR)
        if not 0 < work.start_pos <= self.max_seq_len:
            raise SequenceRefused("start_pos_mismatch", f"sequence {work.seq_id}: a handed-off KV of {work.start_pos} "
                                  "tokens", ErrorType.SERVER_ERROR)
        state = self._new_state(work)
        self.block_tables.add_sequence(work.seq_id)
        try:
            self.block_tables.reserve(work.seq_id, work.start_pos)
        except KVCacheExhaustedError as exc:
            self.block_tables.free_sequence(work.seq_id)
            raise SequenceRefused("kv_cache_exhausted", f"sequence {work.seq_id}: {exc}",
                                  ErrorType.OVERLOADED) from None
        state.num_computed = work.start_pos
        state.unnamed = None  # its first tokens' KV came from another worker: not named here
        self._states[work.seq_id] = state
        return self.block_tables.slots(work.seq_id, 0, work.start_pos)

    def _constraint(self, work: SeqWork) -> Constraint | None:
        grammar = work.sampling.grammar if work.sampling is not None else None
        if grammar is None:
            return None
        if self.tokenizer is None:
            raise SequenceRefused("invalid_sampling", f"sequence {work.seq_id}: structured outputs need the "
                                  "checkpoint's tokenizer, and this one ships none", ErrorType.INVALID_REQUEST)
        try:
            return Constraint(llg_tokenizer(self.tokenizer, self.vocab_size), grammar)
        except AFlexError as exc:
            raise SequenceRefused("invalid_sampling", f"sequence {work.seq_id}: {exc}",
                                  ErrorType.INVALID_REQUEST) from None

    def seq_ids(self) -> list[str]:
        return list(self._states)

    def free(self, seq_id: str) -> bool:
        """Forget a sequence and return its KV blocks; False if it was unknown."""
        if self._states.pop(seq_id, None) is None and not self.block_tables.has_sequence(seq_id):
            return False
        if self.block_tables.has_sequence(seq_id):
            self.block_tables.free_sequence(seq_id)
        return True
