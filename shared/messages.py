"""Control-message schemas of the mesh, and their orjson codec.

Every control message is a pydantic model: it validates what arrives (a malformed message is a
typed `ProtocolError`, never a crash deep in a service), and `model_json_schema()` gives the
JSON Schemas that docs/protocol.md publishes for outside subscribers. Seam tensors do not go
through here: they are binary frames (`shared/transport/header.py`) on the seam, off NATS.
"""

from __future__ import annotations

from typing import TypeVar

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from shared.errors import AFlexError
from shared.kinds import Assignment, ClockPhase, FinishReason, Phase, Role
from shared.model.params import SamplingParams


class ProtocolError(AFlexError):
    """A message on the bus is not valid JSON or does not match its schema."""


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


M = TypeVar("M", bound=Message)


def encode(message: Message) -> bytes:
    return orjson.dumps(message.model_dump(mode="json"))


def decode(cls: type[M], data: bytes) -> M:
    try:
        return cls.model_validate(orjson.loads(data))
    except (orjson.JSONDecodeError, ValidationError) as exc:
        raise ProtocolError(f"invalid {cls.__name__} message: {exc}") from None


class ErrorBody(Message):
    """OpenAI-style error: what the gateway returns to the client."""

    type: str  # invalid_request_error, server_error, overloaded_error, ...
    message: str
    code: str | None = None
    param: str | None = None


# Sampling parameters travel as `shared.model.params.SamplingParams` itself (a frozen dataclass that pydantic
# validates and serialises inside the messages): one declaration of the fields. Stop *strings* stay at the
# gateway (it has the text), so `stop` travels empty.
SamplingSpec = SamplingParams


# -- gateway <-> scheduler ---------------------------------------------------------------------


class SubmitRequest(Message):
    """`aflex.v1.req.submit` (request/reply): a tokenized, validated request."""

    request_id: str
    model: str
    prompt_ids: list[int]
    sampling: SamplingSpec
    arrival_ts: float  # unix seconds at the gateway
    # a continuation (the gateway resubmitting a request whose scheduler was lost): the tokens already
    # streamed, which count against max_tokens and are fed as context, and the OutputDelta index to go on from
    generated_ids: list[int] = Field(default_factory=list)
    first_index: int = Field(default=0, ge=0)
    gateway_id: str = ""  # the gateway run that holds the client: when it is gone, the request is cancelled
    # the gateway may have missed deltas: a scheduler that holds the request (or finished it lately) sends
    # them again from `first_index`; one that does not takes it as a continuation
    resync: bool = False
    # one of the n choices of a request: the request id of the first choice, whose prompt KV this one
    # may share (same prompt) on the same attention worker, instead of prefilling it again
    fork_of: str = ""
    # vLLM's `priority`: a lower value is served first; a request that waited ages toward the front
    # (`shared.policy.batching.prefill_order`), so no class starves
    priority: int = Field(default=0, ge=-(2**31), le=2**31 - 1)


class SubmitReply(Message):
    request_id: str
    accepted: bool
    error: ErrorBody | None = None
    retry_after_s: float | None = None  # set when rejected for overload
    scheduler_instance: str = ""  # which scheduler run took it: its heartbeats say it is still alive


class GatewayHeartbeat(Message):
    """`aflex.v1.gateway.heartbeat`: a gateway run is alive (its `gateway_id` is new at every start)."""

    gateway_id: str
    ts: float


class SchedulerHeartbeat(Message):
    """`aflex.v1.sched.heartbeat`: a scheduler is alive. `instance` is new at every start (the id may repeat)."""

    scheduler_id: str
    instance: str
    ts: float
    reconnects: int = 0  # times this run's NATS connection came back: deltas sent around then may be lost


class Usage(Message):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    energy_j: float | None = None
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache (their prefill not run, nor charged)




class TokenLogprob(Message):
    """One token's log-probability under the model's raw logits, and its `top` alternatives, best first."""

    logprob: float
    top_ids: list[int] = Field(default_factory=list)
    top_logprobs: list[float] = Field(default_factory=list)


class OutputDelta(Message):
    """`aflex.v1.req.<rid>.out`: new tokens of a request; the last one has finish_reason."""

    request_id: str
    index: int  # 0, 1, 2, ... per request, so a subscriber can see a gap
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None  # one per token of `token_ids`, when `sampling.logprobs` asks
    # with `sampling.prompt_logprobs`, on the delta of the first token: one per prompt token (the first: None)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    error: ErrorBody | None = None
    retry_after_s: float | None = None  # with an overloaded error (a request shed before it started): retry then


class CancelRequest(Message):
    """`aflex.v1.req.<rid>.cancel`: the client went away, or a stop string matched."""

    request_id: str
    reason: str = "client_disconnected"
    arrival_ts: float | None = None  # the submission it cancels (its `arrival_ts`), so a resent one spares a reused id


# -- scheduler -> attention worker -> scheduler ---------------------------------------------------


class SeqWork(Message):
    """One sequence's share of a microbatch."""

    seq_id: str
    token_ids: list[int]  # tokens fed in this pass (a prompt chunk, or the last sampled token)
    start_pos: int  # tokens of this sequence already in the worker's KV cache
    sample: bool  # this pass ends at the sequence's last known token: sample the next one
    sampling: SamplingSpec | None = None  # sent on the sequence's first pass on this worker
    generated_ids: list[int] = Field(default_factory=list)  # on the first pass: tokens generated so far
    # on the first pass: the sequence whose KV holds this one's first `start_pos` tokens (shared, copied
    # on write); None: the first pass starts at 0
    fork_of: str | None = None
    # on the first pass: the KV handoff (`KVHandoff.handoff_id`) whose KV, arrived on this worker's KV
    # seam, holds this sequence's first `start_pos` tokens; None: none
    kv_from: str | None = None
    # on the first pass: the content names (`shared.model.block_hash`) of the cached KV blocks that hold
    # this sequence's first `start_pos` tokens on this worker (prefix caching); None: none
    prefix: list[int] | None = None


class MicrobatchDescriptor(Message):
    """`aflex.v1.attn.<wid>.mb`: run one microbatch through every layer with FFN worker `ffn_worker`."""

    mb_id: str
    iteration: int
    phase: Phase
    ffn_worker: str
    seqs: list[SeqWork]
    release: list[str] = Field(default_factory=list)  # sequences whose KV blocks to free first


class KVHandoff(Message):
    """`aflex.v1.attn.<wid>.kv` (request/reply, scheduler -> the prefill attention worker): send the KV of
    sequence `seq_id`'s first `num_tokens` tokens to attention worker `to_worker`'s KV seam. The KV goes
    over torch.distributed, never through NATS; the reply says when it has arrived."""

    handoff_id: str
    seq_id: str
    num_tokens: int
    to_worker: str
    to_address: str


class KVHandoffReply(Message):
    """The prefill worker's answer: the KV arrived (`ok`), its size and how long the move took, or why not."""

    handoff_id: str
    ok: bool
    nbytes: int = 0
    seconds: float = 0.0
    error: ErrorBody | None = None


class SeqResult(Message):
    seq_id: str
    token_id: int | None  # None when the pass did not sample (a prompt chunk)
    logprob: TokenLogprob | None = None  # the sampled token's, when its sampling asks for logprobs
    # with `prompt_logprobs`: the fed tokens' from position `prompt_logprobs_start` on (each from the row before)
    prompt_logprobs: list[TokenLogprob] = Field(default_factory=list)
    prompt_logprobs_start: int = 0


class MicrobatchDone(Message):
    """`aflex.v1.sched.done`: what a microbatch produced, and the worker's KV state after it."""

    mb_id: str
    worker_id: str
    results: list[SeqResult]
    kv_free_blocks: int
    kv_total_blocks: int
    error: ErrorBody | None = None
    failed_seq_ids: list[str] = Field(default_factory=list)  # e.g. KV exhausted: requeue them
    failed_codes: dict[str, str] = Field(default_factory=dict)  # the code of each sequence refused on its own
    attention_s: float = 0.0  # time computing attention, lm_head and sampling
    ffn_wait_s: float = 0.0  # time waiting for the FFN worker (network + FFN compute)
    ffn_compute_s: float = 0.0  # of which the FFN worker's forwards (the rest is transport and queueing)
    total_s: float = 0.0
    energy_j: float | None = None  # this microbatch's GPU energy, attention and FFN sides together
    attention_energy_j: float | None = None
    ffn_energy_j: float | None = None


# -- control --------------------------------------------------------------------------------------

class Register(Message):
    """`aflex.v1.control.register` (request/reply): a worker announces itself."""

    worker_id: str
    role: Role
    model_id: str
    n_layers: int
    kv_total_blocks: int = 0
    block_size: int = 0
    max_seq_len: int = 0
    pid: int = 0
    started_ts: float = 0.0
    gpu_backend: str = ""
    gpu_name: str = ""
    gpu_profile: str = ""  # the GPU profile key (emulated: the one it runs; else guessed from the name)
    supported_clocks_mhz: list[int] = Field(default_factory=list)
    # where this worker's seam takes frames: "gloo://host:port[?gpu=<uuid>]" (torch seam: a TCPStore to
    # rendezvous at) or a NATS subject (nats seam); "" for a worker that is never sent to first
    seam_address: str = ""
    # an attention worker's KV seam (torch seam only): where another attention worker sends it a
    # sequence's KV in a P/D handoff; "" when it takes none (the `nats` seam transport)
    kv_address: str = ""
    # the halves it has loaded, when more than its role's: ["attention", "ffn"] for an attention worker that
    # can serve the whole model (`colocate`), which the global scheduler may assign `colocated`
    halves: list[Role] = Field(default_factory=list)
    gpu_memory_bytes: float = 0.0  # its GPU's memory (NVML's total, or the emulated profile's); 0: unknown
    # a worker group (--attention-tp, --ffn-tp, --ffn-ep): its ranks' devices, rank 0 (this registrant) first
    group_devices: list[str] = Field(default_factory=list)


class RegisterReply(Message):
    ok: bool
    scheduler_id: str
    error: ErrorBody | None = None
    scheduler_instance: str = ""  # new at every scheduler start: a worker seeing it change drops its sequences
    # the answer to a draining worker's heartbeat: nothing the scheduler placed is left on it (None: not asked)
    drained: bool | None = None


class Heartbeat(Message):
    """`aflex.v1.control.heartbeat.<wid>`: liveness and load, every heartbeat period."""

    worker_id: str
    role: Role
    ts: float
    kv_free_blocks: int = 0
    kv_total_blocks: int = 0
    queue_depth: int = 0
    # attention workers: the microbatches running now. A microbatch the scheduler sent a while ago that
    # is neither here nor done was lost on the way (its descriptor or its MicrobatchDone); None: not reported
    active_mb_ids: list[str] | None = None
    # attention workers: the newest descriptor taken; one the scheduler sent after it is still on the way
    newest_mb_id: str | None = None
    seam_address: str = ""  # as in `Register`: attention workers open their seam to an FFN worker here
    # its GPU's energy counter (J, monotonic from the worker's start: NVML or the emulated GPU's model); the
    # global scheduler sums the mesh's to correct each plan kind's power. None: not reported
    gpu_energy_j: float | None = None
    # stopping (SIGTERM): take no new work, let what it holds finish; the scheduler answers `drained`
    draining: bool = False


class WorkerInfo(Message):
    worker_id: str
    role: Role
    healthy: bool
    kv_free_blocks: int = 0
    kv_total_blocks: int = 0
    last_seen_s_ago: float = 0.0
    assignment: Assignment | None = None  # the global scheduler's (None: no plan yet, or provisioning off)


class SchedulerStatus(Message):
    """`aflex.v1.sched.status` reply: ready when at least one attention and one FFN worker are healthy."""

    ready: bool
    scheduler_id: str
    model_id: str | None = None
    workers: list[WorkerInfo] = Field(default_factory=list)
    queue_depth: int = 0
    running: int = 0


# -- frequency commands and telemetry -------------------------------------------------------------

class FrequencyCommand(Message):
    """`aflex.v1.freq.<wid>`: the SM clock a worker runs per phase, until `valid_until_ts`.

    Only the scheduler publishes these. After `valid_until_ts` (unix seconds) without a newer
    command the worker falls back to its default clock, so a dead scheduler never leaves a GPU slow.
    """

    worker_id: str
    clocks_mhz: dict[ClockPhase, int]
    valid_until_ts: float
    issued_ts: float
    reason: str = ""


class PhaseLatency(Message):
    mean_ms: float
    count: int


class DeviceReading(Message):
    """One rank's GPU in a worker group's telemetry."""

    rank: int
    device: str
    clock_mhz: int
    power_w: float
    energy_j: float  # monotonic


class WorkerTelemetry(Message):
    """`aflex.v1.telemetry.<role>.<wid>`: a worker's GPU and work, at the telemetry rate (10 Hz). A worker
    group's rank 0 reports the group: `power_w` and `energy_j` are its devices' sums, `devices` each one."""

    worker_id: str
    role: Role
    ts: float
    gpu_backend: str
    gpu_name: str
    clock_mhz: int
    target_clock_mhz: int | None = None
    command_applied: bool = True  # False on nvml-readonly: the clock was asked for, not set
    power_w: float
    energy_j: float  # monotonic
    utilization: float  # busy fraction of the last period, 0..1
    latency_ms: dict[str, PhaseLatency] = Field(default_factory=dict)  # by phase, last period
    queue_depth: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    tokens_done: int = 0  # monotonic
    microbatches_done: int = 0  # monotonic
    assignment: Assignment | None = None  # the global scheduler's latest for it (None: none received)
    devices: list[DeviceReading] = Field(default_factory=list)  # a group's ranks, rank 0 first ([]: one device)
    # a group's collectives since it formed, by the command they served and their kind: [calls, bytes]
    group_traffic: dict[str, dict[str, list[int]]] = Field(default_factory=dict)


class RoleAssignment(Message):
    """`aflex.v1.control.role.<wid>`: the worker's assignment for this provisioning window (only the
    scheduler publishes). A parked worker takes no work; the scheduler drains it before it parks."""

    worker_id: str
    assignment: Assignment
    plan_id: int  # the plan it belongs to (monotonic per scheduler run)
    issued_ts: float
    reason: str = ""


class WeighedKind(Message):
    """One plan kind the global scheduler weighed: why the plan is the kind it is."""

    predicted_power_w: float
    feasible: bool
    gpus: int  # the GPUs its pools take (the rest parked)


class PlanTelemetry(Message):
    """`aflex.v1.telemetry.plan`: the global scheduler's plan for the window, published at every plan."""

    scheduler_id: str
    ts: float
    plan_id: int
    kind: str  # "pd", "mixed", "colocated" or "pd-colocated" (`shared.policy.Plan.kind`)
    pools: dict[str, list[int]]  # pool -> [attention GPUs, FFN GPUs, attention TP] (colocated: [replicas, TP])
    assignments: dict[str, Assignment]  # worker -> its assignment
    changed: list[str] = Field(default_factory=list)  # workers whose assignment this plan changed
    predicted_power_w: float | None = None
    feasible: bool = True
    load_rps: float = 0.0  # the load planned for (before headroom)
    mean_prompt: float = 0.0
    mean_output: float = 0.0
    p90_prompt: float = 0.0
    reason: str = ""
    # each kind's power correction the plan was ranked with (what its plans drew on the mesh against the pool
    # models); empty when the plan had one kind to choose
    power_factor: dict[str, float] = Field(default_factory=dict)
    # every kind the plan was chosen from: its best plan's predicted power (W, at the load x headroom, parked GPUs
    # included, before `power_factor`) and whether it held the load
    weighed: dict[str, WeighedKind] = Field(default_factory=dict)


class SchedulerTelemetry(Message):
    """`aflex.v1.telemetry.scheduler.<id>`: queue, running sequences and SLO attainment."""

    scheduler_id: str
    ts: float
    queue_depth: int
    running: int
    finished: int  # monotonic
    slo_attainment: float | None = None  # fraction of recent requests within TTFT and TPOT SLOs
    ttft_p90_ms: float | None = None
    tpot_p90_ms: float | None = None
    clocks_mhz: dict[str, dict[str, int]] = Field(default_factory=dict)  # commanded, by worker and phase
    assignments: dict[str, Assignment] = Field(default_factory=dict)  # the global scheduler's, by worker
    plan_id: int = 0  # plans made so far (0: none; provisioning off)
    # P/D handoffs since the scheduler started (monotonic): made, failed (the sequence decoded where it
    # was), the KV bytes moved and the seconds the moves took (request to the decode worker's acknowledgement)
    kv_handoffs: int = 0
    kv_handoff_failures: int = 0
    kv_handoff_bytes: int = 0
    kv_handoff_s: float = 0.0
    # by healthy attention worker: requests queued on it (routed, not yet admitted to a batch) and running on
    # it; `queue_depth` is the waiting ones plus those no worker has taken yet
    waiting_by_worker: dict[str, int] = Field(default_factory=dict)
    running_by_worker: dict[str, int] = Field(default_factory=dict)
