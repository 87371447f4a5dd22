"""One request's life on the bus: subscribe to its outputs, submit it, turn token deltas into text.

Order matters: the output subscription exists before the submission, so no delta can be missed. Deltas
are put back in `index` order; text comes from an `IncrementalDetokenizer` (the prompt's last tokens as
context) and stop strings are cut here, at the gateway, which then cancels the request on the bus.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import nats.errors
from nats.aio.client import Client
from nats.aio.subscription import Subscription

from services.gateway.errors import (
    SERVER_ERROR,
    SERVICE_UNAVAILABLE,
    TIMEOUT,
    APIError,
    from_error_body,
    retry_after_headers,
)
from shared import subjects
from shared.error_types import ErrorType
from shared.messages import (
    CancelRequest,
    OutputDelta,
    ProtocolError,
    SamplingSpec,
    SubmitReply,
    SubmitRequest,
    TokenLogprob,
    Usage,
    decode,
    encode,
)
from shared.model.params import StopStringMatcher
from shared.model.tokenizer import IncrementalDetokenizer, Tokenizer
from shared.transport.bus import BusError, BusTimeoutError, NoRespondersBusError, request

if TYPE_CHECKING:
    from services.gateway.liveness import SchedulerWatch
    from services.gateway.metrics import GatewayMetrics
    from services.gateway.reasoning import ReasoningSplitter

log = logging.getLogger("aflex.gateway")

UNAVAILABLE_RETRY_AFTER_S = 1.0
FAILOVER_FIRST_WAIT_S = 0.1  # between resubmissions while no scheduler takes a request over, doubling
FAILOVER_MAX_WAIT_S = 1.0
GAP_WAIT_S = 0.5  # a later delta came first and the next one has not come this long: it was lost
QUIET_RESYNC_S = 5.0  # no delta this long from a live scheduler: ask it again (cheap; covers a lost last delta)
QUIET = "no delta lately from a live scheduler"


class _Unanswered(Exception):
    """No scheduler took a submission. `late`: it timed out, so one may still take it."""

    def __init__(self, reason: str, *, late: bool = False) -> None:
        super().__init__(reason)
        self.reason, self.late = reason, late


@dataclass
class TextEvent:
    """New text of a request; the last event has `finish_reason` and `usage` (an OpenAI usage dict).

    `logprobs`: the tokens consumed since the last event, with their logprobs where the request asked
    (a token whose text is held back, for a character or a possible stop string, comes with a later
    event); `prompt_logprobs`: on the first event, the prompt's, where asked."""

    text: str
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    logprobs: list[tuple[int, TokenLogprob | None]] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    stop_sequence: str | None = None  # the stop string that ended the answer (Anthropic's `stop_sequence`)
    reasoning: str = ""  # a reasoning model's reasoning, split from `text` (services.gateway.reasoning)


def usage_dict(prompt_tokens: int, completion_tokens: int, energy_j: float | None = None,
               cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage, with `prompt_tokens_details.cached_tokens` (the prompt tokens the prefix cache held)."""
    usage: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                             "total_tokens": prompt_tokens + completion_tokens,
                             "prompt_tokens_details": {"cached_tokens": cached_tokens}}
    if energy_j is not None:
        usage["energy_j"] = energy_j  # AFlex extension: joules the workers spent on this request
    return usage


def cached_tokens(usage: dict[str, Any]) -> int:
    """The prompt tokens the prefix cache held, from an OpenAI usage (`usage_dict`)."""
    return int(usage.get("prompt_tokens_details", {}).get("cached_tokens", 0))


def reasoning_tokens(usage: dict[str, Any]) -> int:
    """A reasoning model's reasoning tokens, from an OpenAI usage (0 where it reported none)."""
    return int(usage.get("completion_tokens_details", {}).get("reasoning_tokens", 0))


def unavailable(message: str) -> APIError:
    return APIError(503, message, type=SERVICE_UNAVAILABLE, code="scheduler_unavailable",
                    headers=retry_after_headers(UNAVAILABLE_RETRY_AFTER_S))


@dataclass(kw_only=True)
class Generation:
    """A submitted request. Use `submit()`, then iterate `events()`, and always `release()` at the end."""

    nc: Client
    request_id: str
    model_id: str
    prompt_ids: list[int]
    sampling: SamplingSpec
    stop: tuple[str, ...]
    tokenizer: Tokenizer
    submit_timeout_s: float
    token_timeout_s: float
    metrics: GatewayMetrics | None = None
    watch: SchedulerWatch | None = None  # None: no failover (the request lives and dies with its scheduler)
    gateway_id: str = ""  # this gateway run (the scheduler cancels the request when it is gone)
    scheduler_silence_s: float = 2.0
    failover_deadline_s: float = 30.0
    fork_of: str = ""  # one of n choices: choice 0's request id, whose prompt KV it may share
    priority: int = 0  # vLLM's: lower is served first
    reasoning: ReasoningSplitter | None = None  # a reasoning model's answer: its reasoning split from the text
    output_ids: list[int] = field(default_factory=list, init=False)  # every token streamed so far
    _instance: str = field(default="", init=False)  # the scheduler run that holds it
    _heard_mono: float = field(default=0.0, init=False)  # its last sign of life (accepted, or an output)
    _synced_epoch: int = field(default=0, init=False)  # `watch.loss_epoch` when it last took the request
    _gap_since: float | None = field(default=None, init=False)  # monotonic: since a later delta came first
    finished: bool = field(default=False, init=False)  # the scheduler is done with it (or we cancelled it)
    _sub: Subscription | None = field(default=None, init=False)
    _pending: dict[int, OutputDelta] = field(default_factory=dict, init=False)
    _next_index: int = field(default=0, init=False)
    _submitted_at: float = field(default=0.0, init=False)  # monotonic; TTFT and e2e latency count from here
    _arrival_ts: float = field(default=0.0, init=False)  # unix seconds, as the scheduler's SLOs count
    _first_token_at: float | None = field(default=None, init=False)

    def _submission(self, *, resync: bool = False) -> SubmitRequest:
        """The request as a scheduler takes it: with what was streamed, a continuation. `resync`: the
        scheduler that holds it sends the deltas from `first_index` again instead of refusing a duplicate."""
        return SubmitRequest(request_id=self.request_id, model=self.model_id, prompt_ids=self.prompt_ids,
                             sampling=self.sampling, arrival_ts=self._arrival_ts, generated_ids=list(self.output_ids),
                             first_index=self._next_index, gateway_id=self.gateway_id, resync=resync,
                             fork_of=self.fork_of, priority=self.priority)

    async def _ask(self, submission: SubmitRequest) -> SubmitReply:
        """One submission's reply; `_Unanswered` when no scheduler took it (none there, no answer, no bus)."""
        try:
            return decode(SubmitReply, await request(self.nc, subjects.REQ_SUBMIT, encode(submission),
                                                     self.submit_timeout_s))
        except NoRespondersBusError:
            raise _Unanswered("no scheduler is running: the request cannot be served now") from None
        except BusTimeoutError:
            raise _Unanswered(f"the scheduler did not answer within {self.submit_timeout_s:g} s", late=True) from None
        except (BusError, nats.errors.Error, OSError) as exc:
            raise _Unanswered(f"the message bus is unavailable: {exc}") from None

    def _taken(self, reply: SubmitReply) -> None:
        self._instance, self._heard_mono = reply.scheduler_instance, time.monotonic()
        if self.watch is not None:
            self._synced_epoch = self.watch.loss_epoch(self._instance)

    async def submit(self) -> None:
        """Subscribe to the outputs, then submit; raise `APIError` when the scheduler does not take it."""
        self._submitted_at, self._arrival_ts = time.monotonic(), time.time()
        self._sub = await self.nc.subscribe(subjects.req_out(self.request_id))
        try:
            try:
                reply = await self._ask(self._submission())
            except _Unanswered as exc:
                if not exc.late:
                    raise
                reply = await self._ask(self._submission(resync=True))  # lost on the way? (taken: sent again)
        except _Unanswered as exc:
            if exc.late:  # it may still be accepted late: do not leave it running
                await self.cancel("submit_timeout")
            self.finished = True
            raise unavailable(exc.reason) from None
        except ProtocolError as exc:
            await self.cancel("bad_submit_reply")
            raise APIError(502, f"the scheduler sent an invalid reply: {exc}", type=SERVER_ERROR) from None
        if not reply.accepted:
            self.finished = True
            raise from_error_body(reply.error, reply.retry_after_s)
        self._taken(reply)

    def _lost(self) -> str | None:
        """Why the request must be resubmitted now, if it must: its scheduler run is gone, or deltas
        may have been lost (a NATS connection came back, or a gap in the indices has lasted)."""
        if self._next_index in self._pending or self.watch is None or not self.watch.watching or not self._instance:
            return None
        now = time.monotonic()
        quiet_s = min(self.watch.silent_s(self._instance), now - self._heard_mono)
        if quiet_s >= self.scheduler_silence_s:
            return f"scheduler {self._instance} is gone"
        if self.watch.loss_epoch(self._instance) != self._synced_epoch:
            return "a NATS connection came back: deltas may be lost"
        if now - self._heard_mono >= QUIET_RESYNC_S:  # a resent delta lost too (a route not yet aware of us)
            return QUIET
        if not self._pending:
            self._gap_since = None
        elif self._gap_since is None:
            self._gap_since = now
        elif now - self._gap_since >= GAP_WAIT_S:
            return f"delta {self._next_index} is missing, later ones came"
        return None

    async def _take_over(self, why: str, *, resync: bool = True) -> None:
        """Resubmit, as a continuation, until a scheduler takes it; `APIError` 503 at the failover deadline.
        With `resync`, a scheduler that still holds it sends the missing deltas again; without, the scheduler
        has ended it and takes it as a new request that goes on from the tokens streamed."""
        log.log(logging.DEBUG if why == QUIET else logging.WARNING, "%s: %s; resubmitting after %d streamed tokens",
                self.request_id, why, len(self.output_ids))
        self._gap_since = None
        deadline = time.monotonic() + self.failover_deadline_s
        wait_s = FAILOVER_FIRST_WAIT_S
        while True:
            try:
                reply = await self._ask(self._submission(resync=resync))
            except _Unanswered as exc:
                reason = exc.reason
            except ProtocolError as exc:
                reason = f"the scheduler sent an invalid reply: {exc}"
            else:
                if reply.accepted:
                    self._taken(reply)
                    log.info("%s: taken by scheduler run %s, %.1f s later", self.request_id,
                             reply.scheduler_instance, time.monotonic() - deadline + self.failover_deadline_s)
                    return
                error = reply.error
                if error is None or error.type not in (ErrorType.SERVICE_UNAVAILABLE, ErrorType.OVERLOADED):
                    self.finished = True
                    raise from_error_body(error, reply.retry_after_s)
                reason = error.message
            if time.monotonic() + wait_s >= deadline:
                self.finished = True
                raise unavailable(f"the request's scheduler is gone and no other took it over within "
                                  f"{self.failover_deadline_s:g} s (last: {reason})")
            await asyncio.sleep(wait_s)
            wait_s = min(FAILOVER_MAX_WAIT_S, 2 * wait_s)

    async def events(self) -> AsyncIterator[TextEvent]:
        """Text as it becomes final; raises `APIError` on a scheduler error or when a token takes too long."""
        detok = IncrementalDetokenizer(self.tokenizer, self.prompt_ids)
        matcher = StopStringMatcher(self.stop)
        n_tokens = 0
        consumed: list[tuple[int, TokenLogprob | None]] = []  # since the last event
        prompt_logprobs: list[TokenLogprob | None] | None = None

        def event(text: str, finish_reason: str | None = None, usage: dict[str, Any] | None = None) -> TextEvent:
            nonlocal consumed, prompt_logprobs
            reasoning = ""
            if self.reasoning is not None:
                reasoning, text = self.reasoning.feed(text)
                if finish_reason is not None:
                    more_reasoning, more_text = self.reasoning.finish()
                    reasoning, text = reasoning + more_reasoning, text + more_text
                    if usage is not None:
                        usage["completion_tokens_details"] = {"reasoning_tokens": self.reasoning.reasoning_tokens}
            made = TextEvent(text, finish_reason, usage, consumed, prompt_logprobs, reasoning=reasoning)
            consumed, prompt_logprobs = [], None
            return made

        def said(made: TextEvent) -> bool:  # text held back (a marker may begin) makes no event yet
            return bool(made.text or made.reasoning or any(lp is not None for _, lp in made.logprobs))

        while True:
            delta = await self._next_delta()
            if self._first_token_at is None and delta.token_ids:
                self._first_token_at = time.monotonic()
            if delta.error is not None:
                self.finished = True
                raise from_error_body(delta.error, delta.retry_after_s)
            if delta.prompt_logprobs is not None:
                prompt_logprobs = delta.prompt_logprobs
            logprobs = delta.logprobs or []
            pieces: list[str] = []
            for i, token_id in enumerate(delta.token_ids):
                n_tokens += 1
                if self.reasoning is not None:
                    self.reasoning.count(token_id)
                consumed.append((token_id, logprobs[i] if i < len(logprobs) else None))
                text, hit = matcher.feed(detok.push(token_id))
                pieces.append(text)
                if hit:  # tokens after the stop string in this delta are dropped, as is everything later
                    await self.cancel("stop_string")
                    usage = usage_dict(len(self.prompt_ids), n_tokens)
                    self._record(usage)
                    ended = event("".join(pieces), "stop", usage)
                    ended.stop_sequence = matcher.matched
                    yield ended
                    return
            if delta.finish_reason is None:
                if any(pieces) and said(made := event("".join(pieces))):
                    yield made
                continue
            if delta.finish_reason == "abort" and not self.finished:
                # Not ours to end: the scheduler took this gateway for gone (a pause longer than its
                # gateway_silence_s) and cancelled it. The client is still here, so it goes on, a continuation.
                if any(pieces) and said(made := event("".join(pieces))):
                    yield made
                await self._take_over("the scheduler cancelled it, taking this gateway for gone", resync=False)
                continue
            self.finished = True
            if delta.finish_reason == "error":
                raise APIError(500, "the request failed in the mesh", type=SERVER_ERROR)
            text, hit = matcher.feed(detok.flush())
            pieces.append(text if hit else text + matcher.flush())
            usage = self._final_usage(delta.usage, n_tokens)
            self._record(usage)
            yield event("".join(pieces), "stop" if hit else delta.finish_reason, usage)
            return

    def _record(self, usage: dict[str, Any]) -> None:
        if self.metrics is not None:
            ttft = None if self._first_token_at is None else self._first_token_at - self._submitted_at
            self.metrics.request_finished(ttft_s=ttft, e2e_s=time.monotonic() - self._submitted_at,
                                          prompt_tokens=usage["prompt_tokens"],
                                          completion_tokens=usage["completion_tokens"],
                                          energy_j=usage.get("energy_j"),
                                          cached_tokens=usage["prompt_tokens_details"]["cached_tokens"])

    def _final_usage(self, usage: Usage | None, n_tokens: int) -> dict[str, Any]:
        if usage is None:
            return usage_dict(len(self.prompt_ids), n_tokens)
        return usage_dict(usage.prompt_tokens, usage.completion_tokens, usage.energy_j, usage.cached_tokens)

    async def _next_delta(self) -> OutputDelta:
        assert self._sub is not None, "submit() first"
        waiting_since = time.monotonic()
        while self._next_index not in self._pending:
            left_s = waiting_since + self.token_timeout_s - time.monotonic()
            slice_s = self.scheduler_silence_s / 2 if self.watch is not None else left_s  # wake to check liveness
            try:
                msg = await self._sub.next_msg(timeout=max(0.001, min(left_s, slice_s)))
            except nats.errors.TimeoutError:
                msg = None
            if msg is not None:
                self._heard_mono = time.monotonic()
                try:
                    delta = decode(OutputDelta, msg.data)
                except ProtocolError as exc:
                    log.warning("%s: dropping an invalid output delta: %s", self.request_id, exc)
                    continue
                if delta.index >= self._next_index:
                    self._pending[delta.index] = delta
            why = self._lost()
            if why is not None:
                await self._take_over(why)
                waiting_since = time.monotonic()
            elif msg is None and time.monotonic() - waiting_since >= self.token_timeout_s:
                await self.cancel("timeout")
                raise APIError(504, f"no output from the mesh within {self.token_timeout_s:g} s", type=TIMEOUT,
                               code="timeout") from None
        self._next_index += 1
        delta = self._pending.pop(self._next_index - 1)
        self.output_ids.extend(delta.token_ids)
        return delta

    async def cancel(self, reason: str) -> None:
        """Tell the scheduler to stop this request (once; nothing after it finished)."""
        if self.finished:
            return
        self.finished = True
        cancel = CancelRequest(request_id=self.request_id, reason=reason, arrival_ts=self._arrival_ts)
        if self.watch is not None:  # sent again if a NATS connection comes back meanwhile (it may be lost)
            self.watch.cancelled(cancel, self._instance)
        try:
            await self.nc.publish(subjects.req_cancel(self.request_id), encode(cancel))
        except Exception as exc:  # a closed or reconnecting connection: sent again when it is back
            log.warning("%s: could not publish cancel (%s): %s", self.request_id, reason, exc)

    async def release(self, reason: str = "client_disconnected") -> None:
        """Cancel if still running, and drop the output subscription."""
        await self.cancel(reason)
        sub, self._sub = self._sub, None
        if sub is not None:
            try:
                await sub.unsubscribe()
            except Exception as exc:  # connection closed: nothing left to unsubscribe from
                log.debug("%s: unsubscribe failed: %s", self.request_id, exc)
