"""Admission of a submitted request, without torch: every reason the scheduler refuses one.

The gateway validates too, but the scheduler is the one that knows the workers' real capacity
(KV blocks x block size, context length from `Register`), and other clients may submit directly.
`validate_request` raises `InvalidRequestError(message, param)`; `rejection` turns that and the
scheduler's own state (a bad or duplicate id, no workers ready, a full queue) into the typed
`ErrorBody` of a refused `SubmitReply`; `overdue` and `shed` refuse, later, the admitted requests that
waited past their queue deadline without starting.
"""

from __future__ import annotations

from collections.abc import Container, Iterator
from dataclasses import dataclass

from services.scheduler import forks
from services.scheduler.state import RequestState, Status
from shared import subjects
from shared.error_types import ErrorType
from shared.errors import InvalidRequestError
from shared.messages import ErrorBody, SubmitRequest

RETRY_AFTER_S = 1.0  # what overloaded / unavailable rejections suggest


@dataclass(frozen=True)
class Mesh:
    """What admission needs to know of the scheduler's state when a request arrives."""

    running_ids: Container[str]
    ready: bool  # attention and FFN workers are serving
    context_limit: int  # the longest sequence a worker can hold
    vocab_size: int | None
    queue_depth: int
    max_queue: int


def rejection(req: SubmitRequest, mesh: Mesh) -> tuple[ErrorBody, float | None] | None:
    """Why `req` is refused (the error, and the retry delay it suggests), or None when it is admitted."""
    rid = req.request_id
    try:
        subjects.check_token(rid)
    except ValueError as exc:
        return ErrorBody(type=ErrorType.INVALID_REQUEST, message=str(exc), code="invalid_request_id",
                         param="request_id"), None
    if rid in mesh.running_ids:
        return ErrorBody(type=ErrorType.INVALID_REQUEST, message=f"request {rid!r} is already running",
                         code="duplicate_request_id", param="request_id"), None
    if not mesh.ready:
        return ErrorBody(type=ErrorType.SERVICE_UNAVAILABLE, message="no attention and FFN workers are ready yet",
                         code="no_workers_ready"), RETRY_AFTER_S
    try:
        validate_request(req, context_limit=mesh.context_limit, vocab_size=mesh.vocab_size)
    except InvalidRequestError as exc:
        return ErrorBody(type=ErrorType.INVALID_REQUEST, message=str(exc), code="invalid_value",
                         param=exc.param), None
    if mesh.queue_depth >= mesh.max_queue:
        return ErrorBody(type=ErrorType.OVERLOADED, message=f"the scheduler queue is full ({mesh.max_queue} "
                         "waiting requests); retry later", code="queue_full"), RETRY_AFTER_S
    return None


def overdue(state: RequestState, now_mono: float, deadline_s: float, *, ready: bool = True) -> ErrorBody | None:
    """The refusal of a request that has waited `deadline_s` since the scheduler took it without starting
    (429; 503 while no workers are `ready`), or None. Only one that has streamed nothing anywhere
    qualifies (its client can still get a status line); one that started and was put back by a fault
    keeps its turn, and choices past the first go with choice 0 (its gateway stops them if it is shed)."""
    waited_s = now_mono - state.received_mono
    if (state.started or state.base_tokens or state.output_ids or forks.follows_choice_zero(state)
            or waited_s < deadline_s):
        return None
    if not ready:
        return ErrorBody(type=ErrorType.SERVICE_UNAVAILABLE, message=f"no attention and FFN workers were ready "
                         f"within queue_deadline_s={deadline_s:g}", code="no_workers_ready")
    return ErrorBody(type=ErrorType.OVERLOADED, message=f"the mesh is overloaded: the request waited {waited_s:.1f} "
                     f"s without starting (queue_deadline_s={deadline_s:g}); retry later", code="queue_deadline")


def shed(states: list[RequestState], now_mono: float, deadline_s: float, *,
         ready: bool) -> Iterator[tuple[RequestState, ErrorBody]]:
    """The waiting requests past their queue deadline, with the refusal each gets (`overdue`): shedding them
    lets the served keep their TTFT. Lazily, so one that started or ended while the caller sent the
    refusal before it is passed over."""
    for state in [s for s in states if s.status is Status.WAITING]:
        error = None if state.finished else overdue(state, now_mono, deadline_s, ready=ready)
        if error is not None:
            yield state, error


def unserved(states: list[RequestState], since_mono: float | None, now_mono: float, bound_s: float
             ) -> Iterator[tuple[RequestState, ErrorBody]]:
    """The requests to end, with their error, when the mesh has had no attention worker with an FFN since
    `since_mono` (None: it has one) for `bound_s` or longer: a half gone for good must not leave a stream
    waiting with no end. Those that never started are the queue deadline's (`shed`)."""
    if since_mono is None or now_mono - since_mono < bound_s:
        return
    for state in states:
        if not state.finished:
            yield state, ErrorBody(type=ErrorType.SERVICE_UNAVAILABLE, code="no_workers_ready",
                                   message=f"no attention worker has had an FFN half to run with for {bound_s:g} s "
                                           "(unserved_bound_s): the request cannot go on")


def validate_request(req: SubmitRequest, *, context_limit: int, vocab_size: int | None = None) -> None:
    """Raise `InvalidRequestError` if `req` cannot run on a worker holding `context_limit` tokens."""
    if not req.prompt_ids:
        raise InvalidRequestError("the prompt is empty", param="prompt")
    if vocab_size is not None and any(not 0 <= t < vocab_size for t in req.prompt_ids):
        raise InvalidRequestError(f"prompt token ids must lie in [0, {vocab_size})", param="prompt")
    req.sampling.validate()  # the ranges of `SamplingParams.validate`, on the spec as it travels
    if vocab_size is not None and any(not 0 <= t < vocab_size for t in req.generated_ids):
        raise InvalidRequestError(f"generated token ids must lie in [0, {vocab_size})", param="generated_ids")
    if len(req.generated_ids) >= req.sampling.max_tokens:
        raise InvalidRequestError(f"a continuation of {len(req.generated_ids)} generated tokens has nothing left "
                                  f"of max_tokens={req.sampling.max_tokens}", param="generated_ids")
    total = len(req.prompt_ids) + req.sampling.max_tokens
    if total > context_limit:
        raise InvalidRequestError(
            f"prompt ({len(req.prompt_ids)} tokens) plus max_tokens ({req.sampling.max_tokens}) is {total} tokens, "
            f"more than the {context_limit} tokens a worker can hold", param="max_tokens")
