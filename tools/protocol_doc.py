"""Generates docs/protocol.md: every NATS subject, every control message's JSON Schema, the tensor frame format.

The document is rendered from the code (shared/subjects.py, the pydantic models of shared/messages.py,
shared/wire.py), so it cannot drift: `python -m tools.protocol_doc` rewrites it, and
`python -m tools.protocol_doc --check` (run by the tests) exits 1 when the file is stale.
What the code cannot say by itself (who publishes, who subscribes, ordering rules, error codes) is
written down here, next to the tables that hold it.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from services.scheduler.admission import RETRY_AFTER_S
from services.scheduler.recovery import MAX_FAILURES
from shared import messages, subjects, wire
from shared.error_types import ErrorType
from shared.messages import Message
from shared.settings import AttentionWorkerSettings, GatewaySettings, SchedulerSettings, WorkerSettings


def _default(settings: type[Any], name: str) -> str:
    return f"{settings.model_fields[name].default:g} s"


DOC_PATH = Path(__file__).resolve().parent.parent / "docs" / "protocol.md"


@dataclass(frozen=True)
class SubjectDoc:
    """One row of the subject table."""

    names: tuple[str, ...]  # the constants / functions of shared/subjects.py that build this subject
    pattern: str
    route: str  # from → to
    kind: str  # publish, or request/reply
    queue: str  # queue group, or "—"
    payload: str  # message type(s), markdown
    notes: str


SUBJECTS: tuple[SubjectDoc, ...] = (
    SubjectDoc(("REQ_SUBMIT", "SCHEDULER_QUEUE"), subjects.REQ_SUBMIT, "gateway → scheduler", "request/reply",
               f"`{subjects.SCHEDULER_QUEUE}`", "[`SubmitRequest`](#submitrequest) → [`SubmitReply`](#submitreply)",
               "The reply says accepted, or rejected with a typed `ErrorBody` (and `retry_after_s` on overload). "
               "No responders means no scheduler is running."),
    SubjectDoc(("req_out",), subjects.req_out("<rid>"), "scheduler → gateway", "publish", "—",
               "[`OutputDelta`](#outputdelta)",
               "Token deltas with a per-request `index` (0, 1, 2, …); the last one has `finish_reason` and `usage`."),
    SubjectDoc(("req_cancel", "REQ_CANCEL_ALL"), subjects.req_cancel("<rid>"), "gateway → scheduler", "publish", "—",
               "[`CancelRequest`](#cancelrequest)",
               f"The scheduler subscribes to `{subjects.REQ_CANCEL_ALL}`. Reasons the gateway sends: "
               "`client_disconnected`, `stop_string`, `timeout`, `submit_timeout`, `bad_submit_reply`."),
    SubjectDoc(("attn_mb",), subjects.attn_mb("<wid>"), "scheduler → attention worker; FFN worker → attention worker",
               "publish", "—",
               "[`MicrobatchDescriptor`](#microbatchdescriptor) (JSON) or a [tensor frame](#tensor-frames) "
               "(`direction: to_attention`)",
               "One subject, two encodings: a payload starting with `AFX1` is a tensor frame, one starting with "
               "`{` a descriptor. A descriptor with no `seqs` only releases KV blocks."),
    SubjectDoc(("ffn_mb",), subjects.ffn_mb("<wid>"), "attention worker → FFN worker", "publish", "—",
               "[tensor frame](#tensor-frames) (`direction: to_ffn`)",
               "The frame's `reply_to` names the attention worker's `attn.<wid>.mb` subject; the answer goes there."),
    SubjectDoc(("SCHED_DONE",), subjects.SCHED_DONE, "attention worker → scheduler", "publish", "—",
               "[`MicrobatchDone`](#microbatchdone)",
               "Exactly one per descriptor that carried sequences, whatever happened to it."),
    SubjectDoc(("SCHED_STATUS",), subjects.SCHED_STATUS, "gateway (`/ready`), tools → scheduler", "request/reply",
               "—", "any payload (ignored; the gateway sends `{}`) → [`SchedulerStatus`](#schedulerstatus)",
               "Ready when at least one attention and one FFN worker are healthy."),
    SubjectDoc(("CONTROL_REGISTER",), subjects.CONTROL_REGISTER, "attention / FFN worker → scheduler",
               "request/reply", "—", "[`Register`](#register) → [`RegisterReply`](#registerreply)",
               "Sent after the worker subscribed to its `.mb` subject; retried until a scheduler accepts it. "
               "`ok: false` is a refusal and the worker gives up."),
    SubjectDoc(("heartbeat", "CONTROL_HEARTBEAT_ALL"), subjects.heartbeat("<wid>"),
               "attention / FFN worker → scheduler", "request (reply optional)", "—",
               "[`Heartbeat`](#heartbeat) → optionally [`RegisterReply`](#registerreply)",
               f"The scheduler subscribes to `{subjects.CONTROL_HEARTBEAT_ALL}` and does not answer today. "
               "A worker that gets *no responders* (no scheduler) or a `RegisterReply` with `ok: false` registers "
               "again; a timeout is the normal case."),
    SubjectDoc(("freq",), subjects.freq("<wid>"), "scheduler → worker", "publish", "—",
               "[`FrequencyCommand`](#frequencycommand)",
               "The SM clock per phase for worker `<wid>`, valid until `valid_until_ts`; without a newer command "
               "the worker then falls back to its default clock. Only the scheduler may publish here."),
    SubjectDoc(("telemetry", "TELEMETRY_ALL"), subjects.telemetry("<role>", "<wid>"), "worker, scheduler → anyone",
               "publish", "—",
               "[`WorkerTelemetry`](#workertelemetry) (`<role>` = `attention`, `ffn`), "
               "[`SchedulerTelemetry`](#schedulertelemetry) (`<role>` = `scheduler`)",
               f"Power, energy, clock, latency, queue and KV use. Observers subscribe to `{subjects.TELEMETRY_ALL}`; "
               "counters marked monotonic only grow while the publisher lives."),
)

# Models without a docstring of their own.
_DESCRIPTIONS = {
    "SubmitReply": "`aflex.v1.req.submit` reply: accepted, or rejected with a typed error "
                   "(`retry_after_s` set when the rejection is for overload or unavailability).",
    "Usage": "Token counts of a finished request; `energy_j` is AFlex's extension (joules spent on it).",
    "SeqResult": "One sequence's outcome in a microbatch: the sampled token, or null when the pass did not sample.",
    "RegisterReply": "`aflex.v1.control.register` reply (and the optional heartbeat reply): `ok: false` refuses "
                     "the worker, or, on a heartbeat, asks it to register again.",
    "WorkerInfo": "One worker as the scheduler sees it, inside `SchedulerStatus`.",
    "PhaseLatency": "Mean latency and count of one phase's work over the last telemetry period.",
}


def message_types() -> list[type[Message]]:
    """Every Message subclass defined in shared/messages.py, in source order."""
    return [obj for obj in vars(messages).values()
            if isinstance(obj, type) and issubclass(obj, Message) and obj is not Message
            and obj.__module__ == messages.__name__]


def _sampling() -> messages.SamplingSpec:
    return messages.SamplingSpec(temperature=0.7, top_p=0.95, seed=7, max_tokens=64, stop_token_ids=[2])


def _error() -> messages.ErrorBody:
    return messages.ErrorBody(type=ErrorType.OVERLOADED, message="the scheduler queue is full (256 waiting requests); "
                              "retry later", code="queue_full")


def _seq_work() -> messages.SeqWork:
    return messages.SeqWork(seq_id="req-3f2a", token_ids=[1, 2593, 314, 253], start_pos=0, sample=True,
                            sampling=_sampling())


def _worker_info() -> messages.WorkerInfo:
    return messages.WorkerInfo(worker_id="attn-0", role="attention", healthy=True, kv_free_blocks=480,
                               kv_total_blocks=512, last_seen_s_ago=0.4)


EXAMPLES: dict[str, Callable[[], Message]] = {
    "ErrorBody": _error,
    "SamplingSpec": _sampling,
    "SubmitRequest": lambda: messages.SubmitRequest(request_id="req-3f2a", model="SmolLM2-135M-Instruct",
                                                    prompt_ids=[1, 2593, 314, 253], sampling=_sampling(),
                                                    arrival_ts=1767225600.25),
    "SubmitReply": lambda: messages.SubmitReply(request_id="req-3f2a", accepted=False, error=_error(),
                                                retry_after_s=1.0),
    "Usage": lambda: messages.Usage(prompt_tokens=4, completion_tokens=12, total_tokens=16),
    "OutputDelta": lambda: messages.OutputDelta(request_id="req-3f2a", index=11, token_ids=[2], finish_reason="stop",
                                                usage=messages.Usage(prompt_tokens=4, completion_tokens=12,
                                                                     total_tokens=16)),
    "CancelRequest": lambda: messages.CancelRequest(request_id="req-3f2a", reason="stop_string"),
    "SeqWork": _seq_work,
    "MicrobatchDescriptor": lambda: messages.MicrobatchDescriptor(mb_id="9c1d04aa-attn-0-17-0", iteration=17,
                                                                  phase="prefill", ffn_worker="ffn-0",
                                                                  seqs=[_seq_work()], release=["req-1b07"]),
    "SeqResult": lambda: messages.SeqResult(seq_id="req-3f2a", token_id=28),
    "MicrobatchDone": lambda: messages.MicrobatchDone(mb_id="9c1d04aa-attn-0-17-0", worker_id="attn-0",
                                                      results=[messages.SeqResult(seq_id="req-3f2a", token_id=28)],
                                                      kv_free_blocks=480, kv_total_blocks=512, attention_s=0.012,
                                                      ffn_wait_s=0.019, total_s=0.031),
    "Register": lambda: messages.Register(worker_id="attn-0", role="attention", model_id="SmolLM2-135M-Instruct",
                                          n_layers=30, kv_total_blocks=512, block_size=16, max_seq_len=8192,
                                          pid=4242, started_ts=1767225590.0),
    "RegisterReply": lambda: messages.RegisterReply(ok=True, scheduler_id="scheduler-0"),
    "Heartbeat": lambda: messages.Heartbeat(worker_id="attn-0", role="attention", ts=1767225601.0,
                                            kv_free_blocks=480, kv_total_blocks=512, queue_depth=2),
    "WorkerInfo": _worker_info,
    "SchedulerStatus": lambda: messages.SchedulerStatus(ready=True, scheduler_id="scheduler-0",
                                                        model_id="SmolLM2-135M-Instruct", workers=[_worker_info()],
                                                        queue_depth=0, running=3),
    "FrequencyCommand": lambda: messages.FrequencyCommand(worker_id="ffn-0", clocks_mhz={"prefill": 1200,
                                                                                          "decode": 570},
                                                          valid_until_ts=1767225660.0, issued_ts=1767225600.0,
                                                          reason="decode TPOT slack"),
    "PhaseLatency": lambda: messages.PhaseLatency(mean_ms=4.2, count=120),
    "WorkerTelemetry": lambda: messages.WorkerTelemetry(
        worker_id="ffn-0", role="ffn", ts=1767225601.1, gpu_backend="emulated", gpu_name="A800-SXM4-80GB",
        clock_mhz=570, target_clock_mhz=570, power_w=143.5, energy_j=51234.5, utilization=0.62,
        latency_ms={"decode": messages.PhaseLatency(mean_ms=4.2, count=120)}, queue_depth=1, tokens_done=98304,
        microbatches_done=4096),
    "SchedulerTelemetry": lambda: messages.SchedulerTelemetry(
        scheduler_id="scheduler-0", ts=1767225601.0, queue_depth=0, running=3, finished=812, slo_attainment=0.97,
        ttft_p90_ms=212.0, tpot_p90_ms=61.5, clocks_mhz={"ffn-0": {"prefill": 1200, "decode": 570}}),
}


def example(cls: type[Message]) -> Message:
    return EXAMPLES[cls.__name__]()


def description(cls: type[Message]) -> str:
    doc = cls.__dict__.get("__doc__")
    return inspect.cleandoc(doc) if doc else _DESCRIPTIONS[cls.__name__]


def subject_of(cls: type[Message]) -> list[str]:
    """Subject patterns whose row names `cls` as (part of) the payload."""
    return [row.pattern for row in SUBJECTS if f"[`{cls.__name__}`]" in row.payload]


def nested_in(cls: type[Message]) -> list[str]:
    """Names of the other messages whose schema embeds `cls`."""
    return [other.__name__ for other in message_types()
            if other is not cls and cls.__name__ in other.model_json_schema().get("$defs", {})]


def _anchor(name: str) -> str:
    return name.lower()


# Error codes (ErrorBody.code / .type) as the code sets them: (code, type, where, meaning).
ERROR_CODES: tuple[tuple[str, str, str, str], ...] = (
    ("invalid_message", ErrorType.INVALID_REQUEST, "scheduler → `SubmitReply`",
     "the submission is not a valid `SubmitRequest` (`request_id` is then empty)"),
    ("invalid_request_id", ErrorType.INVALID_REQUEST, "scheduler → `SubmitReply`",
     "`request_id` cannot be a subject token (empty, or holds `.`, `*`, `>` or whitespace); `param: request_id`"),
    ("duplicate_request_id", ErrorType.INVALID_REQUEST, "scheduler → `SubmitReply`",
     "a request with this id is already running; `param: request_id`"),
    ("no_workers_ready", ErrorType.SERVICE_UNAVAILABLE, "scheduler → `SubmitReply`",
     f"no attention and FFN workers are ready yet; `retry_after_s` = {RETRY_AFTER_S:g}"),
    ("invalid_value", ErrorType.INVALID_REQUEST, "scheduler → `SubmitReply`",
     "admission validation failed (context length, token ids, sampling); `param` names the field"),
    ("queue_full", ErrorType.OVERLOADED, "scheduler → `SubmitReply`",
     f"the scheduler queue is full (`max_queue` waiting requests); `retry_after_s` = {RETRY_AFTER_S:g}"),
    ("request_failed", ErrorType.SERVER_ERROR, "scheduler → `OutputDelta` (`finish_reason: error`)",
     f"the request failed `MAX_FAILURES` ({MAX_FAILURES}) times; the message carries the last reason"),
    ("(none)", ErrorType.INVALID_REQUEST, "scheduler → `RegisterReply` (`ok: false`)",
     "the registration is not a valid `Register`, or `worker_id` is not a valid subject token"),
    ("invalid_descriptor", ErrorType.INVALID_REQUEST, "attention worker → `MicrobatchDone`",
     "the descriptor did not validate; answered only when it still names an `mb_id`"),
    ("sequence_busy", ErrorType.SERVER_ERROR, "attention worker → `MicrobatchDone`",
     "the sequence is already in another in-flight microbatch"),
    ("invalid_tokens", ErrorType.INVALID_REQUEST, "attention worker → `MicrobatchDone`",
     "no token ids to feed, or a token id outside the vocabulary"),
    ("context_length_exceeded", ErrorType.INVALID_REQUEST, "attention worker → `MicrobatchDone`; gateway (HTTP 400)",
     "more tokens than the model's context"),
    ("start_pos_mismatch", ErrorType.SERVER_ERROR, "attention worker → `MicrobatchDone`",
     "`start_pos` disagrees with the KV the worker holds (resend from 0 with `sampling` and `generated_ids`)"),
    ("missing_sampling", ErrorType.INVALID_REQUEST, "attention worker → `MicrobatchDone`",
     "a sequence's first pass on this worker did not carry `sampling`"),
    ("invalid_sampling", ErrorType.INVALID_REQUEST, "attention worker → `MicrobatchDone`",
     "the sampling parameters are out of range"),
    ("kv_cache_exhausted", ErrorType.OVERLOADED, "attention worker → `MicrobatchDone`",
     "no KV blocks left for the sequence; the scheduler re-routes it"),
    ("microbatch_failed", ErrorType.SERVER_ERROR, "attention worker → `MicrobatchDone`",
     "the whole microbatch failed: an FFN error frame, no FFN reply within "
     f"{AttentionWorkerSettings().ffn_reply_timeout_s:g} s (`ffn_reply_timeout_s`, env "
     "`AFLEX_FFN_REPLY_TIMEOUT_S`), a wrong reply shape, the worker "
     "shutting down, or an exception"),
    ("scheduler_unavailable", ErrorType.SERVICE_UNAVAILABLE, "gateway (HTTP 503)",
     f"no responders on `{subjects.REQ_SUBMIT}`, no answer within `submit_timeout_s` "
     f"({_default(GatewaySettings, 'submit_timeout_s')} by default), or the bus is down"),
    ("timeout", ErrorType.TIMEOUT, "gateway (HTTP 504)", "no `OutputDelta` within `request_timeout_s` "
     f"({_default(GatewaySettings, 'request_timeout_s')} by default); the request is cancelled"),
)

_HTTP_STATUS = tuple((str(t), str(t.http_status)) for t in ErrorType)

_FRAME_FIELDS: tuple[tuple[str, str, str], ...] = (
    ("mb_id", "string", "the microbatch (`MicrobatchDescriptor.mb_id`)"),
    ("layer", "int", "the layer index, 0 ≤ layer < n_layers"),
    ("direction", '"to_ffn" \\| "to_attention"', "`to_ffn`: attention → FFN (`ffn_in`); `to_attention`: FFN → "
     "attention (`ffn_out`)"),
    ("reply_to", "string", "`to_ffn` only: the subject the FFN worker answers on (the sender's `attn.<wid>.mb`)"),
    ("worker_id", "string", "the sending worker"),
    ("error", "string", "`to_attention` only, on failure: why the FFN worker could not serve the frame; the "
     "tensor is then empty (`shape: [0]`)"),
    ("dtype", "string", f"one of {', '.join(f'`{d}`' for d in wire._DTYPES)}"),
    ("shape", "int[]", "the whole tensor's shape: `[T, D]` (tokens of the microbatch, hidden size)"),
    ("nbytes", "int", "bytes of the whole tensor (all chunks together)"),
    ("chunk", "int", "index of this chunk, 0 ≤ chunk < chunks"),
    ("chunks", "int", "how many frames carry this tensor"),
)


def _signature(name: str) -> str:
    obj = getattr(subjects, name)
    if callable(obj):
        params = ", ".join(inspect.signature(obj).parameters)
        return f"`{name}({params})`"
    return f"`{name}`"


def _intro() -> list[str]:
    p = subjects.PREFIX
    return [
        "# AFlex wire protocol (`aflex.v1`)",
        "",
        "<!-- Generated by `python -m tools.protocol_doc` from shared/subjects.py, shared/messages.py and "
        "shared/wire.py. Do not edit by hand: the tests fail when this file and the code disagree. -->",
        "",
        "The mesh (gateway, scheduler, attention workers, FFN workers) talks over NATS only. This page lists every "
        "subject, who publishes and who subscribes, the JSON Schema of every control message, and the binary "
        "tensor frames that carry the hidden states between the attention and FFN halves. The architecture "
        "behind it is in [architecture.md](architecture.md).",
        "",
        "## Conventions",
        "",
        f"- **Versioning.** Every subject starts with `{p}` (`PREFIX` in `shared/subjects.py`). A change to a "
        "subject, or an incompatible change to a message, is a new version (`aflex.v2`); v1 subjects keep their "
        "meaning. Adding an optional field with a default is compatible: receivers ignore fields they do not "
        "know (`extra=\"ignore\"`), and absent fields take the defaults shown in the schemas.",
        "- **Control messages** are JSON objects encoded with orjson (`shared.messages.encode`: "
        "`model_dump(mode=\"json\")`, UTF-8, no whitespace). A receiver validates them against the schemas below "
        "(`shared.messages.decode`); an invalid message is logged and dropped (or answered with an error where "
        "the subject is request/reply), never fatal.",
        "- **Tensor frames** are binary (`shared/wire.py`): they carry the per-layer seam tensors on the hot path "
        "and never go through JSON. See [Tensor frames](#tensor-frames).",
        "- **Tokens.** `<rid>` (request id) and `<wid>` (worker id) become subject tokens: `check_token` in "
        "`shared/subjects.py` refuses empty ids and ids holding `.`, `*`, `>` or whitespace.",
        "- **Request/reply** uses NATS's own reply inboxes (`_INBOX.>`) with an explicit timeout on every "
        "request; *no responders* (nobody subscribed) is a distinct, immediate error.",
        "- **Queue groups.** Only submissions are load-balanced: the scheduler subscribes to "
        f"`{subjects.REQ_SUBMIT}` in queue group `{subjects.SCHEDULER_QUEUE}` (`SCHEDULER_QUEUE`). Every other "
        "subscription is plain; one scheduler runs per mesh today.",
        "",
        "### Outside subscribers",
        "",
        "Dashboards, `aflex top` and recorders should only listen: subscribe to "
        f"`{subjects.TELEMETRY_ALL}` (telemetry), `{subjects.CONTROL_HEARTBEAT_ALL}` (liveness and load of each "
        f"worker), `{subjects.SCHED_DONE}` (every microbatch's result and timing) or `{subjects.req_out('*')}` "
        f"(all token streams), and ask `{subjects.SCHED_STATUS}` (request/reply) for the mesh's state. Validate "
        "what arrives against the schemas below and ignore unknown fields. Do not publish on mesh subjects: a "
        "stray descriptor, cancel or heartbeat changes what the mesh does. Payloads on `attn.<wid>.mb` may be "
        "JSON or binary; check the first bytes (`AFX1`).",
        "",
        "### Permissions by prefix",
        "",
        "The subjects are laid out so that NATS per-user permissions can be written by prefix:",
        "",
        "| prefix | publishers | subscribers |",
        "|---|---|---|",
        f"| `{p}.req.*` | gateway (`submit`, `<rid>.cancel`), scheduler (`<rid>.out`) | scheduler, gateway |",
        f"| `{p}.attn.<wid>.mb` | scheduler, FFN workers | attention worker `<wid>` |",
        f"| `{p}.ffn.<wid>.mb` | attention workers | FFN worker `<wid>` |",
        f"| `{p}.sched.*` | attention workers (`done`), gateway and tools (`status` requests) | scheduler |",
        f"| `{p}.freq.<wid>` | **the scheduler only** | worker `<wid>` |",
        f"| `{p}.telemetry.>` | workers, scheduler | anyone |",
        f"| `{p}.control.*` | workers (`register`, `heartbeat.<wid>`) | scheduler |",
        "",
        "An illustrative `authorization` block (not shipped; the embedded and compose servers run without users):",
        "",
        "```",
        "authorization {",
        "  users: [",
        f'    {{user: gateway, permissions: {{publish: ["{p}.req.submit", "{p}.req.*.cancel", "{p}.sched.status"],',
        f'                                  subscribe: ["{p}.req.*.out", "_INBOX.>"]}}}}',
        f'    {{user: scheduler, permissions: {{publish: ["{p}.req.*.out", "{p}.attn.*.mb", "{p}.freq.*",',
        f'                                              "{p}.telemetry.scheduler.*"],',
        f'                                    subscribe: ["{p}.req.submit", "{p}.req.*.cancel", "{p}.sched.>",',
        f'                                                "{p}.control.>"],',
        "                                    allow_responses: true}}",
        f'    {{user: attention, permissions: {{publish: ["{p}.ffn.*.mb", "{p}.sched.done", "{p}.control.>",',
        f'                                              "{p}.telemetry.attention.*"],',
        f'                                    subscribe: ["{p}.attn.*.mb", "{p}.freq.*", "_INBOX.>"]}}}}',
        f'    {{user: ffn, permissions: {{publish: ["{p}.attn.*.mb", "{p}.control.>", "{p}.telemetry.ffn.*"],',
        f'                              subscribe: ["{p}.ffn.*.mb", "{p}.freq.*", "_INBOX.>"]}}}}',
        f'    {{user: observer, permissions: {{publish: {{deny: ">"}}, subscribe: ["{p}.telemetry.>"]}}}}',
        "  ]",
        "}",
        "```",
        "",
    ]


def _subject_table() -> list[str]:
    lines = [
        "## Subjects",
        "",
        "| subject | in `shared/subjects.py` | from → to | pattern | queue group | message |",
        "|---|---|---|---|---|---|",
    ]
    for row in SUBJECTS:
        names = ", ".join(_signature(n) for n in row.names)
        lines.append(f"| `{row.pattern}` | {names} | {row.route} | {row.kind} | {row.queue} | {row.payload} |")
    lines += ["", "Notes per subject:", ""]
    for row in SUBJECTS:
        lines.append(f"- `{row.pattern}`: {row.notes}")
    lines.append("")
    return lines


def _ordering() -> list[str]:
    return [
        "## Ordering and delivery rules",
        "",
        "NATS core delivery is at most once, and ordered per publisher and subject. The services build on that:",
        "",
        f"1. **Subscribe before submit.** The gateway subscribes to `{subjects.req_out('<rid>')}` *before* it "
        f"sends `{subjects.REQ_SUBMIT}`, so no delta can be missed.",
        "2. **Deltas are ordered by `index`.** Each request's `OutputDelta`s carry `index` 0, 1, 2, …; the gateway "
        "puts them back in index order and drops duplicates. The delta with `finish_reason` is the last one.",
        "3. **Cancellation** is fire-and-forget: after a cancel the scheduler ends the request with a final "
        "`OutputDelta` (`finish_reason: abort`) and frees its KV with the worker's next descriptor.",
        "4. **One iteration at a time per attention worker.** The scheduler publishes an iteration's "
        "descriptors (its microbatches, `mb_id` = `<run>-<wid>-<iteration>-<k>`), then waits for every "
        f"`MicrobatchDone` (or `microbatch_timeout_s`, {_default(SchedulerSettings, 'microbatch_timeout_s')} by "
        "default) before it plans the next iteration for that worker.",
        "5. **Release first.** A descriptor's `release` list is applied before its `seqs`; a sequence released "
        "while it is in flight is freed when its microbatch ends.",
        f"6. **Exactly one `MicrobatchDone`** on `{subjects.SCHED_DONE}` per descriptor with sequences, even when "
        "some or all sequences fail (`failed_seq_ids`, `error`). A descriptor without sequences (release only) "
        "is not awaited; if a `MicrobatchDone` comes for it, it only updates KV counts.",
        "7. **Seam round trips.** For every layer the attention worker publishes `ffn_in` to the FFN worker the "
        "descriptor names and awaits the `to_attention` frame with the same `(mb_id, layer)`; frames nobody waits "
        "for are dropped. Several microbatches of one attention worker interleave at these awaits. Workers carry "
        "these frames (and the attention worker also its descriptors) on a second connection of their own to the "
        "same server, speaking the NATS protocol directly (`shared/seam_link.py`; `AFLEX_SEAM_TRANSPORT=nats-py` "
        "puts them on the worker's nats-py connection instead): to everyone else it is one more client, and "
        "the subjects and frames are the same either way.",
        "8. **The FFN worker serves frames oldest first**, merging into one forward the oldest queued frame of "
        "the same layer and dtype from each other `reply_to` (attention worker); two microbatches of one attention "
        "worker are never merged, which would put its pipeline back in lockstep. Each part goes back to its own "
        "`reply_to`.",
        "9. **Failures are recomputed, not repaired.** A request's token history lives at the scheduler; a "
        "worker's KV is disposable. Failed sequences, timed-out microbatches and lost or restarted attention "
        "workers all lead to the sequence being re-routed and recomputed from prompt + output tokens "
        "(`SeqWork.generated_ids` carries the tokens so far on a sequence's first pass on a worker).",
        f"10. **Liveness.** Workers send a `Heartbeat` every `heartbeat_period_s` "
        f"({_default(WorkerSettings, 'heartbeat_period_s')} by default); a worker silent for `heartbeat_timeout_s` "
        f"({_default(SchedulerSettings, 'heartbeat_timeout_s')}) is unhealthy and its in-flight microbatches fail. A "
        "`MicrobatchDone` counts as a heartbeat. A `Register` from a worker the scheduler already knows is a "
        "restart: its KV is taken as empty and what it held is recomputed. An attention worker's heartbeat lists "
        "the microbatches it is running (`active_mb_ids`): one the scheduler sent more than "
        f"`microbatch_lost_after_s` ({_default(SchedulerSettings, 'microbatch_lost_after_s')}) ago that is "
        "neither listed nor done a moment later was lost on the way (descriptor or `MicrobatchDone`) and is "
        "recomputed; when the scheduler's own connection drops, everything in flight is recomputed at once. "
        "`microbatch_timeout_s` stays the last resort for workers that do not report `active_mb_ids`. Attention "
        "workers listen to the FFN workers' heartbeats too: a seam hop waiting on an FFN worker that has sent "
        f"none for `ffn_silence_s` ({_default(AttentionWorkerSettings, 'ffn_silence_s')}) fails then, not at "
        f"`ffn_reply_timeout_s` ({_default(AttentionWorkerSettings, 'ffn_reply_timeout_s')}).",
        "",
    ]


def _messages() -> list[str]:
    lines = ["## Messages", ""]
    lines += [f"- [`{cls.__name__}`](#{_anchor(cls.__name__)})" for cls in message_types()]
    lines.append("")
    for cls in message_types():
        name = cls.__name__
        lines += [f"### {name}", "", description(cls), ""]
        on = subject_of(cls)
        if on:
            lines.append("Subject: " + ", ".join(f"`{s}`" for s in on) + ".")
        inside = nested_in(cls)
        if inside:
            lines.append("Part of: " + ", ".join(f"[`{n}`](#{_anchor(n)})" for n in inside) + ".")
        if on or inside:
            lines.append("")
        lines += ["Example:", "", "```json",
                  orjson.dumps(example(cls).model_dump(mode="json"), option=orjson.OPT_INDENT_2).decode(),
                  "```", "", "JSON Schema:", "", "```json",
                  json.dumps(cls.model_json_schema(), indent=2, ensure_ascii=False), "```", ""]
    return lines


def _frames() -> list[str]:
    lines = [
        "## Tensor frames",
        "",
        "Seam tensors travel as binary frames (`shared/wire.py`), on `attn.<wid>.mb` and `ffn.<wid>.mb`:",
        "",
        "```",
        f"{wire.MAGIC.decode()} | u32 header length (big-endian) | orjson header | raw tensor bytes",
        "```",
        "",
        f"- `MAGIC` is the 4 bytes `{wire.MAGIC.decode()}`; the header length is an unsigned 32-bit "
        "big-endian integer (`struct` format `!I`); the header is a JSON object; the rest of the payload is the "
        "tensor's bytes, row-major, in the host's byte order (little-endian on every supported platform; "
        "`bfloat16` and `float16` are sent as their 16-bit patterns).",
        "- **Chunking.** A tensor bigger than one message is split: each chunk carries up to "
        "`max_payload - 1024 - len(header)` bytes, and every chunk repeats the full header with its own `chunk` "
        "index. The attention worker reassembles by `(mb_id, layer, direction)`, the FFN worker by "
        "`(reply_to, mb_id, layer, direction)` (two attention workers may use the same `mb_id`). The embedded "
        "and compose nats-servers set `max_payload` to 8 MB, so chunking is rare in practice.",
        "",
        "Header fields:",
        "",
        "| field | type | meaning |",
        "|---|---|---|",
    ]
    lines += [f"| `{f}` | {t} | {m} |" for f, t, m in _FRAME_FIELDS]
    lines += [
        "",
        "What crosses the seam for every layer `l` (`shared/model/seam.py`):",
        "",
        "```",
        "attention -> FFN:  ffn_in[l]  = post_attention_norm(residual + attn_out)   [T, D]   direction to_ffn",
        "FFN -> attention:  ffn_out[l] = FFN_l(ffn_in[l])                           [T, D]   direction to_attention",
        "```",
        "",
        "`T` is the number of tokens the microbatch feeds in this pass (all its sequences' rows, stacked) and `D` "
        "the model's hidden size. The residual stream stays on the attention side: the attention worker adds "
        "`ffn_out[l]` to it and applies layer `l+1`'s input norm in one fused step, so only one `[T, D]` tensor "
        "crosses each way per layer and the FFN worker is stateless (it can serve any attention worker and merge "
        "microbatches of the same layer). An FFN reply must have the shape of its `ffn_in`, or the microbatch "
        "fails. See [architecture.md](architecture.md) for the split itself.",
        "",
        "An FFN worker answers a frame it cannot serve (wrong direction or layer, a shape that is not `[T, D]`, a "
        "failing forward) with an **error frame**: header `error` set, an empty tensor, sent to the frame's "
        "`reply_to`. Frames without `mb_id` or `reply_to` are dropped.",
        "",
    ]
    return lines


def _errors() -> list[str]:
    lines = [
        "## Errors",
        "",
        "Errors on the bus are [`ErrorBody`](#errorbody) objects (`type`, `message`, `code`, `param`), the shape "
        "of OpenAI's error body. `MicrobatchDone.error` holds the first failure's `type` and `code` with every "
        "failure's message joined by `; `; the sequences concerned are in `failed_seq_ids`, and the scheduler "
        "re-routes them for recomputation. A `MicrobatchDone` whose `error` is set (the attention worker sets "
        "it whenever it lists failed sequences, KV exhaustion included), a microbatch that times out and one whose "
        "attention worker is lost while it runs count toward each request's failure limit (`MAX_FAILURES` = "
        f"{MAX_FAILURES}); requests only queued or running (not in flight) on a lost or restarted worker are moved "
        "without counting.",
        "",
        "| code | type | set by | meaning |",
        "|---|---|---|---|",
    ]
    lines += [f"| `{c}` | `{t}` | {w} | {m} |" for c, t, w, m in ERROR_CODES]
    lines += [
        "",
        "The gateway turns a scheduler error into an HTTP status by `type`:",
        "",
        "| type | HTTP status |",
        "|---|---|",
    ]
    lines += [f"| `{t}` | {s} |" for t, s in _HTTP_STATUS]
    lines += [
        "",
        "The types and their statuses are one enum, `shared.error_types.ErrorType`, which the scheduler, the "
        "workers and the gateway all use; a `code` names the cause in words and never carries a status. Any other "
        "type is 500; 429 and 503 carry `Retry-After` from `retry_after_s`. A request that ends with "
        "`finish_reason: error` is HTTP 500, and an invalid reply from "
        "the scheduler is HTTP 502.",
        "",
    ]
    return lines


def render() -> str:
    """The full text of docs/protocol.md."""
    return "\n".join([*_intro(), *_subject_table(), *_ordering(), *_messages(), *_frames(), *_errors()]).rstrip() \
        + "\n"


def documented_subject_names() -> set[str]:
    return {name for row in SUBJECTS for name in row.names}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.protocol_doc", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/protocol.md differs from render()")
    parser.add_argument("--path", type=Path, default=DOC_PATH, help="where the document lives")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = args.path.read_text(encoding="utf-8") if args.path.exists() else ""
        if current != text:
            print(f"{args.path} is stale: run `python -m tools.protocol_doc`", file=sys.stderr)
            return 1
        return 0
    args.path.parent.mkdir(parents=True, exist_ok=True)
    args.path.write_text(text, encoding="utf-8")
    print(f"wrote {args.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
