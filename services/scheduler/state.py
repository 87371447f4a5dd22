"""Per-request state: everything needed to stream a request and to re-run it on another worker.

The scheduler, not the attention worker, owns a request's token history. A worker holds only KV
entries that can be rebuilt, so losing a worker (or its KV blocks) costs recomputation, never the
request: `reset_for_recompute` forgets the placement and the next pass feeds every token again.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from shared.kinds import FinishReason
from shared.messages import SamplingSpec, TokenLogprob
from shared.model.finish_rule import finish_reason
from shared.token_history import TokenHistory


class Status(enum.Enum):
    WAITING = "waiting"  # queued on a worker (or unplaced), nothing in that worker's KV yet
    RUNNING = "running"  # admitted on `worker_id`: some of its tokens are in that worker's KV
    FINISHED = "finished"


@dataclass(eq=False)
class RequestState(TokenHistory):
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingSpec
    arrival_ts: float  # unix seconds at the gateway
    received_mono: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    first_token_ts: float | None = None  # unix seconds when the first token was streamed
    last_token_ts: float | None = None  # unix seconds when the latest token was streamed
    energy_j: float | None = None  # its share of the energy of every microbatch it was in (None: none reported)
    worker_id: str | None = None  # attention worker that holds (or will hold) its KV
    num_computed: int = 0  # tokens whose K/V are in `worker_id`'s cache
    first_pass_sent: bool = False  # sampling spec and generated_ids already sent to `worker_id`
    started: bool = False  # taken into a running set once (admission.overdue never sheds it after)
    status: Status = Status.WAITING
    finish_reason: FinishReason | None = None
    failures: int = 0  # passes lost to worker errors, timeouts or worker loss
    next_index: int = 0  # index of the next OutputDelta
    base_index: int = 0  # a continuation's first delta index here (outputs.py counts from it)
    base_tokens: int = 0  # and the tokens it was streamed before (its `generated_ids`)
    in_flight: bool = False  # part of a microbatch whose MicrobatchDone has not come back
    gateway_id: str = ""  # the gateway run its client is on ("": not watched)
    logprobs: list[TokenLogprob | None] = field(default_factory=list)  # per token generated here (past base_tokens)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # per prompt token, as the prefill passes report them
    fork_from: str | None = None  # its first pass shares this request's prompt KV (forks.py)
    kv_from: str | None = None  # its first pass on `worker_id` takes the KV of this P/D handoff (handoff.py)
    forks: list[RequestState] = field(default_factory=list)  # choices waiting to share its prompt KV
    held_by: RequestState | None = None  # the request whose `forks` this one waits in
    choice_of: str = ""  # one of n choices: choice 0's request id ("": choice 0, or a lone request)
    priority: int = 0  # vLLM's: lower is served first (SubmitRequest.priority)
    prefix_names: list[int] | None = None  # its first pass takes these cached KV blocks (prefix_index.py)
    cached_tokens: int = 0  # prompt tokens it took from the prefix cache (not computed for it)
    named_blocks: int = 0  # full blocks of it the prefix index has learned its worker holds
    last_block_name: int | None = None  # the name of the last of those (the next names chain from it)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def ttft_s(self) -> float | None:
        """Time to first token (first token - arrival at the gateway), as vLLM's benchmark defines it."""
        return None if self.first_token_ts is None else max(0.0, self.first_token_ts - self.arrival_ts)

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first: (last - first) / (n - 1); None below 2 tokens."""
        n = len(self.output_ids)
        if n < 2 or self.first_token_ts is None or self.last_token_ts is None:
            return None
        return (self.last_token_ts - self.first_token_ts) / (n - 1)

    def note_prompt_logprobs(self, start: int, entries: list[TokenLogprob]) -> None:
        """Prompt logprobs for positions `start`, `start + 1`, ...; by position, so a recompute's are the same."""
        if self.prompt_logprobs is None:
            self.prompt_logprobs = [None] * len(self.prompt_ids)
        for position, entry in enumerate(entries, start):
            if position < len(self.prompt_ids):
                self.prompt_logprobs[position] = entry

    def reset_for_recompute(self) -> None:
        """Forget the placement: the next worker rebuilds the KV from prompt + output tokens."""
        self.worker_id = None
        self.num_computed = 0
        self.fork_from = None
        self.kv_from = None
        self.prefix_names = None
        self.cached_tokens = 0
        self.named_blocks = 0
        self.last_block_name = None
        self.first_pass_sent = False
        self.status = Status.WAITING
        self.in_flight = False

    def finish_reason_after(self, token_id: int, eos_token_ids: frozenset[int]) -> FinishReason | None:
        """Why the request ends if `token_id` is appended now (call before appending), or None.

        The mesh's one decision of the finish rule (`shared.model.finish_rule`): the workers only sample.
        """
        return finish_reason(self.sampling, len(self.output_ids), token_id, eos_token_ids,
                             constrained=self.sampling.grammar is not None)
