"""Each request's `OutputDelta`s, in index order, and sent again to a gateway that missed some.

NATS core delivers at most once: when a node of a NATS cluster dies, or a connection drops and comes
back, deltas published around it may be lost. A gateway that suspects so (its own connection or the
scheduler's came back, or a later index arrived first) resubmits the request with `resync`, and
the scheduler sends again every delta from the gateway's `first_index` on. Every delta but the last
carries exactly one token, so delta k is the request's token `base_tokens + k - base_index` (and its
logprob, when asked, `logprobs[k - base_index]`): nothing more is stored for a running request. A
finished one is kept `keep_finished_s` for its final delta.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any

from nats.aio.client import Client

from services.scheduler.state import RequestState
from shared import subjects
from shared.messages import OutputDelta, encode


class OutputStream:
    def __init__(self, nc: Client, keep_finished_s: float = 60.0, max_finished: int = 4096) -> None:
        self.nc = nc
        self.keep_finished_s, self.max_finished = keep_finished_s, max_finished
        # request id -> (finished at, monotonic; the state; its final delta, encoded)
        self._finished: OrderedDict[str, tuple[float, RequestState, bytes]] = OrderedDict()

    async def token(self, state: RequestState) -> None:
        """The delta of the request's latest token (`state.output_ids[-1]`)."""
        await self._publish(state, encode(token_delta(state, state.next_index)))

    async def final(self, state: RequestState, delta: OutputDelta) -> None:
        """The last delta (finish_reason set, index `state.next_index`); remembered a while for a resync."""
        data = encode(delta)
        self._finished[state.request_id] = (time.monotonic(), state, data)
        self._forget_old(time.monotonic())
        await self._publish(state, data)

    async def _publish(self, state: RequestState, data: bytes) -> None:
        state.next_index += 1
        await self.nc.publish(subjects.req_out(state.request_id), data)

    def finished(self, request_id: str) -> RequestState | None:
        """A request that finished within `keep_finished_s` (its deltas can still be sent again)."""
        self._forget_old(time.monotonic())
        entry = self._finished.get(request_id)
        return None if entry is None else entry[1]

    async def resend(self, state: RequestState, from_index: int) -> int:
        """Publish again every delta of `state` from `from_index` on; how many."""
        entry = self._finished.get(state.request_id)
        last = state.next_index - 1 if entry is not None else state.next_index  # the final delta's index
        first = max(from_index, state.base_index)
        for index in range(first, last):
            await self.nc.publish(subjects.req_out(state.request_id), encode(token_delta(state, index)))
        if entry is not None and from_index <= last:
            await self.nc.publish(subjects.req_out(state.request_id), entry[2])
        return max(0, last - first) + (entry is not None and from_index <= last)

    def _forget_old(self, now: float) -> None:
        while self._finished:
            finished_mono = next(iter(self._finished.values()))[0]
            if len(self._finished) <= self.max_finished and now - finished_mono < self.keep_finished_s:
                return
            self._finished.popitem(last=False)


def token_delta(state: RequestState, index: int, **final: Any) -> OutputDelta:
    """Delta `index`: its token with its logprob (and, for the request's first token, the prompt's
    logprobs) where the sampling asks; `final` adds what the last delta carries (finish_reason, usage)."""
    k = index - state.base_index
    token_id = state.output_ids[state.base_tokens + k]
    logprob = state.logprobs[k] if state.sampling.logprobs is not None and k < len(state.logprobs) else None
    prompt = state.prompt_logprobs if state.base_tokens + k == 0 else None
    return OutputDelta(request_id=state.request_id, index=index, token_ids=[token_id],
                       logprobs=None if logprob is None else [logprob], prompt_logprobs=prompt, **final)
