"""The OpenAI error types every service answers with, and the HTTP status each one means.

One vocabulary for the scheduler's rejections (`SubmitReply.error`), a request's final error
(`OutputDelta.error`), the workers' `MicrobatchDone.error` and the gateway's HTTP bodies, so a type
means the same status wherever it is read. An `ErrorBody.code` names what went wrong in words
(`queue_full`, `no_workers_ready`); it never carries an HTTP status.
"""

from __future__ import annotations

import enum


class ErrorType(enum.StrEnum):
    INVALID_REQUEST = "invalid_request_error"
    AUTHENTICATION = "authentication_error"
    NOT_FOUND = "not_found_error"
    RATE_LIMIT = "rate_limit_error"
    OVERLOADED = "overloaded_error"
    SERVICE_UNAVAILABLE = "service_unavailable_error"
    TIMEOUT = "timeout_error"
    SERVER_ERROR = "server_error"

    @property
    def http_status(self) -> int:
        return _HTTP_STATUS[self]

    @classmethod
    def status_of(cls, type_name: str) -> int:
        """The HTTP status of an error type as it travels (a plain string); 500 for a type not listed."""
        try:
            return cls(type_name).http_status
        except ValueError:
            return 500


_HTTP_STATUS = {
    ErrorType.INVALID_REQUEST: 400,
    ErrorType.AUTHENTICATION: 401,
    ErrorType.NOT_FOUND: 404,
    ErrorType.RATE_LIMIT: 429,
    ErrorType.OVERLOADED: 429,
    ErrorType.SERVICE_UNAVAILABLE: 503,
    ErrorType.TIMEOUT: 504,
    ErrorType.SERVER_ERROR: 500,
}
RETRY_STATUSES = frozenset({429, 503})  # the statuses that carry Retry-After

# `ErrorBody.code`s another service acts on. What each costs the sequences is the scheduler's
# judgement (services/scheduler/recovery.py, `judge`), not written here.
# A microbatch failed because its FFN worker could not be reached (seam broken, silent): the
# scheduler routes around that worker until it is heard from again.
FFN_UNREACHABLE = "ffn_unreachable"
# The worker still runs an earlier pass of the sequence (a microbatch the scheduler took for lost
# while a saturated worker had not started it yet).
SEQUENCE_BUSY = "sequence_busy"
# The choice a fork was to share the prompt with is gone (it prefills the prompt itself).
FORK_PARENT_MISSING = "fork_parent_missing"
# The KV a P/D handoff sent for the sequence is not on the worker its next pass went to (it never
# arrived, or expired): the sequence is recomputed from its tokens.
KV_HANDOFF_MISSING = "kv_handoff_missing"
# The cached KV blocks a first pass named (`SeqWork.prefix`) are not all on the worker (evicted): the
# sequence starts again from its first token, and the scheduler forgets that the worker held them.
PREFIX_MISSING = "prefix_missing"
# The prefill worker could not reach the decode worker's KV seam: the scheduler sends that worker no
# moves for a few seconds (it is probably gone; its heartbeats will say).
KV_HANDOFF_UNREACHABLE = "kv_handoff_unreachable"
