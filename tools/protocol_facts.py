"""What docs/protocol.md says that the code cannot say by itself: who publishes and subscribes each
subject, an example of every message, the error codes with their types and meanings, the frame header.

tools/protocol_doc.py renders these tables (with the schemas it reads from the code) into the doc.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.scheduler.admission import RETRY_AFTER_S
from services.scheduler.recovery import MAX_FAILURES
from shared import messages, subjects
from shared.error_types import FFN_UNREACHABLE, ErrorType
from shared.messages import Message
from shared.settings import AttentionWorkerSettings, GatewaySettings
from shared.transport import header as seam_header


def default_s(settings: type[Any], name: str) -> str:
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
               "No responders means no scheduler is running. With `resync: true` a scheduler that holds the "
               "request (or finished it within a minute) publishes its deltas from `first_index` on again; one "
               "that does not takes it as a continuation."),
    SubjectDoc(("req_out",), subjects.req_out("<rid>"), "scheduler → gateway", "publish", "—",
               "[`OutputDelta`](#outputdelta)",
               "Token deltas with a per-request `index` (0, 1, 2, …), one token each but the last, which has "
               "`finish_reason` and `usage`. At most once, as all of NATS core: a gateway that sees a gap last, "
               "or a NATS connection come back (its own, or the scheduler's `reconnects`), resubmits with `resync`."),
    SubjectDoc(("req_cancel", "REQ_CANCEL_ALL"), subjects.req_cancel("<rid>"), "gateway → scheduler", "publish", "—",
               "[`CancelRequest`](#cancelrequest)",
               f"The scheduler subscribes to `{subjects.REQ_CANCEL_ALL}`. Reasons the gateway sends: "
               "`client_disconnected`, `stop_string`, `timeout`, `submit_timeout`, `bad_submit_reply`."),
    SubjectDoc(("attn_mb",), subjects.attn_mb("<wid>"), "scheduler → attention worker", "publish", "—",
               "[`MicrobatchDescriptor`](#microbatchdescriptor)",
               "A descriptor with no `seqs` only releases KV blocks. Seam tensors never travel here."),
    SubjectDoc(("attn_kv",), subjects.attn_kv("<wid>"), "scheduler → attention worker", "request/reply", "—",
               "[`KVHandoff`](#kvhandoff) → [`KVHandoffReply`](#kvhandoffreply)",
               "P/D pools: the prefill worker sends the sequence's KV to the decode worker's KV seam "
               "(`Register.kv_address`) over torch.distributed and answers once the decode worker acknowledged "
               "it. The KV never travels here; the sequence's next pass names it (`SeqWork.kv_from`)."),
    SubjectDoc(("seam",), subjects.seam("<wid>"), "attention worker ↔ FFN worker (`nats` seam only)", "publish",
               "—", "[seam frame](#seam-frames)",
               "Only with `seam_transport: nats`: each worker takes frames on its own subject, and a frame's reply "
               "subject is the sender's. On the default `torch` seam frames go over torch.distributed instead."),
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
               f"The scheduler subscribes to `{subjects.CONTROL_HEARTBEAT_ALL}` and answers only a worker it has "
               "no registration of (a new scheduler run), with `ok: false`. A worker that gets *no responders* (no "
               "scheduler) or `ok: false` registers again, and an attention worker that finds a new "
               "`scheduler_instance` frees the sequences of the run before; a timeout is the normal case."),
    SubjectDoc(("drain", "CONTROL_DRAIN_ALL"), subjects.drain("<wid>"), "attention / FFN worker → scheduler",
               "request/reply", "—", "[`Heartbeat`](#heartbeat) (`draining: true`) → [`RegisterReply`](#registerreply)",
               "A worker given SIGTERM asks here, every 0.2 s, until the reply says `drained: true` or its "
               "`drain_timeout_s` passes. Only the scheduler subscribes: *no responders* means no scheduler, and "
               "the worker stops at once. `ok: false` (a scheduler that does not know it) means drained too."),
    SubjectDoc(("SCHED_HEARTBEAT",), subjects.SCHED_HEARTBEAT, "scheduler → gateways", "publish", "—",
               "[`SchedulerHeartbeat`](#schedulerheartbeat)",
               "Every `heartbeat_s`. A request whose scheduler run (`SubmitReply.scheduler_instance`) sends neither "
               "output nor a heartbeat for `scheduler_silence_s` is resubmitted by its gateway as a continuation "
               "(`generated_ids`, `first_index`) to whichever scheduler takes over."),
    SubjectDoc(("GATEWAY_HEARTBEAT",), subjects.GATEWAY_HEARTBEAT, "gateway → schedulers", "publish", "—",
               "[`GatewayHeartbeat`](#gatewayheartbeat)",
               "Every `heartbeat_s`, with an id new at each gateway start (also in every `SubmitRequest`). A "
               "gateway unheard for `gateway_silence_s` is gone: the scheduler cancels its requests."),
    SubjectDoc(("freq",), subjects.freq("<wid>"), "scheduler → worker", "publish", "—",
               "[`FrequencyCommand`](#frequencycommand)",
               "The SM clock per phase for worker `<wid>`, valid until `valid_until_ts`; without a newer command "
               "the worker then falls back to its default clock. Only the scheduler may publish here."),
    SubjectDoc(("role",), subjects.role("<wid>"), "scheduler → worker", "publish", "—",
               "[`RoleAssignment`](#roleassignment)",
               "The worker's assignment for the provisioning window (`provisioning: aflex`), sent to every worker "
               "at every plan. A parked worker takes no new work; what it holds finishes first, then it waits at "
               "the clock its frequency commands give (warm: the lowest). Only the scheduler may publish here."),
    SubjectDoc(("TELEMETRY_PLAN",), subjects.TELEMETRY_PLAN, "scheduler → anyone", "publish", "—",
               "[`PlanTelemetry`](#plantelemetry)",
               "The global scheduler's plan, every provisioning window: its kind, pools, the load it is for, its "
               "predicted power (modelled), each worker's assignment and which ones it changed."),
    SubjectDoc(("telemetry", "TELEMETRY_ALL"), subjects.telemetry("<role>", "<wid>"), "worker, scheduler → anyone",
               "publish", "—",
               "[`WorkerTelemetry`](#workertelemetry) (`<role>` = `attention`, `ffn`), "
               "[`SchedulerTelemetry`](#schedulertelemetry) (`<role>` = `scheduler`)",
               f"Power, energy, clock, latency, queue and KV use. Observers subscribe to `{subjects.TELEMETRY_ALL}`; "
               "counters marked monotonic only grow while the publisher lives."),
)

# Models without a docstring of their own.
DESCRIPTIONS = {
    "SubmitReply": "`aflex.v1.req.submit` reply: accepted, or rejected with a typed error "
                   "(`retry_after_s` set when the rejection is for overload or unavailability).",
    "Usage": "Token counts of a finished request; `energy_j` is AFlex's extension (joules spent on it).",
    "SeqResult": "One sequence's outcome in a microbatch: the sampled token, or null when the pass did not sample.",
    "RegisterReply": "`aflex.v1.control.register` reply (and the optional heartbeat reply): `ok: false` refuses "
                     "the worker, or, on a heartbeat, asks it to register again.",
    "WorkerInfo": "One worker as the scheduler sees it, inside `SchedulerStatus`.",
    "PhaseLatency": "Mean latency and count of one phase's work over the last telemetry period.",
    "DeviceReading": "One rank's GPU inside a worker group's `WorkerTelemetry` (`devices`).",
    "WeighedKind": "One plan kind the global scheduler weighed, inside `PlanTelemetry` (`weighed`).",
}


def message_types() -> list[type[Message]]:
    """Every Message subclass defined in shared/messages.py, in source order."""
    return [obj for obj in vars(messages).values()
            if isinstance(obj, type) and issubclass(obj, Message) and obj is not Message
            and obj.__module__ == messages.__name__]


def _sampling() -> messages.SamplingSpec:
    return messages.SamplingSpec(temperature=0.7, top_p=0.95, seed=7, max_tokens=64, stop_token_ids=(2,))


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
    "SubmitRequest": lambda: messages.SubmitRequest(request_id="req-3f2a", model="SmolLM2-135M-Instruct",
                                                    prompt_ids=[1, 2593, 314, 253], sampling=_sampling(),
                                                    arrival_ts=1767225600.25, gateway_id="gw-5e0a1b2c"),
    "SubmitReply": lambda: messages.SubmitReply(request_id="req-3f2a", accepted=False, error=_error(),
                                                retry_after_s=1.0),  # (accepted: with scheduler_instance)
    "Usage": lambda: messages.Usage(prompt_tokens=4, completion_tokens=12, total_tokens=16),
    "TokenLogprob": lambda: messages.TokenLogprob(logprob=-0.31, top_ids=[2, 28], top_logprobs=[-0.31, -1.62]),
    "OutputDelta": lambda: messages.OutputDelta(request_id="req-3f2a", index=11, token_ids=[2], finish_reason="stop",
                                                usage=messages.Usage(prompt_tokens=4, completion_tokens=12,
                                                                     total_tokens=16)),
    "CancelRequest": lambda: messages.CancelRequest(request_id="req-3f2a", reason="stop_string"),
    "SeqWork": _seq_work,
    "MicrobatchDescriptor": lambda: messages.MicrobatchDescriptor(mb_id="9c1d04aa-attn-0-17-0", iteration=17,
                                                                  phase="prefill", ffn_worker="ffn-0",
                                                                  seqs=[_seq_work()], release=["req-1b07"]),
    "KVHandoff": lambda: messages.KVHandoff(handoff_id="9c1d04aa-kv17", seq_id="req-3f2a", num_tokens=412,
                                            to_worker="attn-1", to_address="gloo://10.0.0.7:41873"),
    "KVHandoffReply": lambda: messages.KVHandoffReply(handoff_id="9c1d04aa-kv17", ok=True, nbytes=3375104,
                                                      seconds=0.0042),
    "SeqResult": lambda: messages.SeqResult(seq_id="req-3f2a", token_id=28),
    "MicrobatchDone": lambda: messages.MicrobatchDone(mb_id="9c1d04aa-attn-0-17-0", worker_id="attn-0",
                                                      results=[messages.SeqResult(seq_id="req-3f2a", token_id=28)],
                                                      kv_free_blocks=480, kv_total_blocks=512, attention_s=0.012,
                                                      ffn_wait_s=0.019, total_s=0.031),
    "Register": lambda: messages.Register(worker_id="attn-0", role="attention", model_id="SmolLM2-135M-Instruct",
                                          n_layers=30, kv_total_blocks=512, block_size=16, max_seq_len=8192,
                                          pid=4242, started_ts=1767225590.0),
    "RegisterReply": lambda: messages.RegisterReply(ok=True, scheduler_id="scheduler-0", scheduler_instance="9c1d04aa"),
    "GatewayHeartbeat": lambda: messages.GatewayHeartbeat(gateway_id="gw-5e0a1b2c", ts=1767225601.0),
    "SchedulerHeartbeat": lambda: messages.SchedulerHeartbeat(scheduler_id="scheduler-0", instance="9c1d04aa",
                                                              ts=1767225601.0),
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
    "DeviceReading": lambda: messages.DeviceReading(rank=1, device="cuda:1", clock_mhz=570, power_w=141.0,
                                                    energy_j=50871.2),
    "RoleAssignment": lambda: messages.RoleAssignment(worker_id="attn-1", assignment="parked-warm", plan_id=12,
                                                      issued_ts=1767225600.0, reason="mixed plan for 0.42 req/s x 1.3"),
    "PlanTelemetry": lambda: messages.PlanTelemetry(
        scheduler_id="scheduler-0", ts=1767225600.0, plan_id=12, kind="mixed", pools={"mixed": [1, 1, 1]},
        assignments={"attn-0": "mixed-attention", "attn-1": "parked-warm", "ffn-0": "ffn", "ffn-1": "parked-warm"},
        changed=["attn-1", "ffn-1"], predicted_power_w=212.4, load_rps=0.42, mean_prompt=412.0, mean_output=180.0,
        p90_prompt=1100.0, reason="mixed plan for 0.42 req/s x 1.3",
        weighed={"mixed": messages.WeighedKind(predicted_power_w=212.4, feasible=True, gpus=2),
                 "pd": messages.WeighedKind(predicted_power_w=301.9, feasible=True, gpus=4)}),
    "WeighedKind": lambda: messages.WeighedKind(predicted_power_w=212.4, feasible=True, gpus=2),
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
    return inspect.cleandoc(doc) if doc else DESCRIPTIONS[cls.__name__]


def subject_of(cls: type[Message]) -> list[str]:
    """Subject patterns whose row names `cls` as (part of) the payload."""
    return [row.pattern for row in SUBJECTS if f"[`{cls.__name__}`]" in row.payload]


def nested_in(cls: type[Message]) -> list[str]:
    """Names of the other messages whose schema embeds `cls`."""
    return [other.__name__ for other in message_types()
            if other is not cls and cls.__name__ in other.model_json_schema().get("$defs", {})]


def anchor(name: str) -> str:
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
    ("queue_deadline", ErrorType.OVERLOADED, "scheduler → `OutputDelta` (`finish_reason: error`)",
     "the request waited `queue_deadline_s` without starting (nothing streamed); the delta's `retry_after_s` = "
     f"{RETRY_AFTER_S:g}, and the gateway answers 429 (a stream's status line waits for its first token)"),
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
    ("fork_parent_missing", ErrorType.SERVER_ERROR, "attention worker → `MicrobatchDone`",
     "a fork's first pass (`fork_of`) names a sequence this worker no longer holds that far; the scheduler "
     "sends it again from 0"),
    ("kv_handoff_missing", ErrorType.SERVER_ERROR, "attention worker → `MicrobatchDone`",
     "a handed-off sequence's first pass (`kv_from`) names KV that is not on this worker (never arrived, expired, "
     "or does not fit); the scheduler sends it again from 0"),
    ("kv_handoff_conflict", ErrorType.SERVER_ERROR, "attention worker → `MicrobatchDone`",
     "a handed-off sequence's first pass names a sequence this worker already holds"),
    ("kv_handoff_unreachable", ErrorType.SERVER_ERROR, "attention worker → `KVHandoffReply`",
     "the prefill worker could not reach the decode worker's KV seam; the sequence decodes where it is, and the "
     "scheduler sends that worker no moves for a few seconds (it is probably gone: its heartbeats will say)"),
    ("kv_handoff_failed", ErrorType.SERVER_ERROR, "attention worker → `KVHandoffReply`",
     "the prefill worker could not send the KV (the sequence is unknown or busy there, or the decode worker's "
     "KV seam failed); the sequence decodes where it is"),
    ("kv_cache_exhausted", ErrorType.OVERLOADED, "attention worker → `MicrobatchDone`",
     "no KV blocks left for the sequence; the scheduler re-routes it"),
    ("microbatch_failed", ErrorType.SERVER_ERROR, "attention worker → `MicrobatchDone`",
     "the whole microbatch failed: an FFN error frame, a wrong reply shape, the worker shutting down, or an "
     "exception"),
    (FFN_UNREACHABLE, ErrorType.SERVER_ERROR, "attention worker → `MicrobatchDone`",
     "the whole microbatch failed because its FFN worker could not be reached: its seam broke, it sent no "
     "heartbeat for `ffn_silence_s`, or no reply came within "
     f"{AttentionWorkerSettings().ffn_reply_timeout_s:g} s (`ffn_reply_timeout_s`). The scheduler routes around "
     "that FFN worker until its next heartbeat and recomputes the sequences without counting it against them"),
    ("scheduler_unavailable", ErrorType.SERVICE_UNAVAILABLE, "gateway (HTTP 503)",
     f"no responders on `{subjects.REQ_SUBMIT}`, no answer within `submit_timeout_s` "
     f"({default_s(GatewaySettings, 'submit_timeout_s')} by default), or the bus is down"),
    ("timeout", ErrorType.TIMEOUT, "gateway (HTTP 504)", "no `OutputDelta` within `request_timeout_s` "
     f"({default_s(GatewaySettings, 'request_timeout_s')} by default); the request is cancelled"),
)

HTTP_STATUS = tuple((str(t), str(t.http_status)) for t in ErrorType)

FRAME_FIELDS: tuple[tuple[str, str, str], ...] = (
    ("magic", "4 bytes", f"`{seam_header.MAGIC.decode()}`"),
    ("kind", "u8", "0 `to_ffn` (attention → FFN, `ffn_in`), 1 `to_attention` (FFN → attention, `ffn_out`), "
     "2 `error` (FFN → attention: the payload is the reason, utf-8)"),
    ("phase", "u8", "0 decode, 1 prefill: the clock phase the FFN worker runs the forward at"),
    ("dtype", "u8", "index into " + ", ".join(f"`{str(d).removeprefix('torch.')}`" for d in seam_header._DTYPES)),
    ("ndim", "u8", f"how many of the {seam_header.MAX_DIMS} dims are used"),
    ("on_device", "u8", "1: the payload follows GPU to GPU on the pair's NCCL group, not after the header"),
    ("(pad)", "3 bytes", "zero"),
    ("layer", "i32", "the layer index, 0 ≤ layer < n_layers"),
    ("reply_tag", "u32", "a request: the tag its reply is sent on (the requester's posted receive); a reply: its "
     "request's"),
    ("device_seq", "u32", "`on_device` only: the payload's place in the pair's NCCL order, one count per "
     "direction (NCCL matches by order, so the receiver posts its receives in it)"),
    ("shape", f"{seam_header.MAX_DIMS} × u64", "the tensor's shape, `[T, D]` for seam tensors (unused dims 0)"),
    ("nbytes", "u64", "the payload's length; must equal the shape's elements × the dtype's size"),
    ("energy_j", "f64", "`to_attention`: this frame's share (by rows) of the FFN forward's GPU energy"),
    ("compute_s", "f64", "`to_attention`: that forward's compute time"),
    ("mb_id length", "u16", f"bytes of `mb_id` used, at most {seam_header.MB_ID_MAX_BYTES}"),
    ("mb_id", f"{seam_header.MB_ID_MAX_BYTES} bytes", "the microbatch (`MicrobatchDescriptor.mb_id`), utf-8, "
     "zero padded"),
    ("(end pad)", f"{seam_header.END_PAD_BYTES} bytes", "zero: the header is a multiple of 16 bytes, so a payload "
     "right after it can be viewed as any dtype in place"),
)
