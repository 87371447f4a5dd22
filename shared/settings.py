"""Settings of every service: one pydantic-settings class each, from flags or `AFLEX_*` env.

The CLI builds these from its flags; a value not given on the command line comes from the
environment (`AFLEX_NATS_URL`, `AFLEX_PORT`, ...) and then from the defaults here.
"""

from __future__ import annotations

from typing import Literal

from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.bus import DEFAULT_NATS_URL


class ServiceSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="AFLEX_", extra="ignore")

    nats_url: str = DEFAULT_NATS_URL
    log_level: str = "INFO"


class GatewaySettings(ServiceSettings):
    host: str = "0.0.0.0"
    port: int = 8000
    model: str = "default"  # path or `default`: the gateway reads only the tokenizer from it
    served_model_name: str | None = None  # the id clients send; defaults to the checkpoint's id
    submit_timeout_s: float = 10.0
    request_timeout_s: float = 600.0  # longest a request may wait for its next token
    api_key: str | None = None  # when set, `Authorization: Bearer <key>` is required


class SchedulerSettings(ServiceSettings):
    scheduler_id: str = "scheduler-0"
    model: str = "default"  # the scheduler reads the model card (id, context, EOS ids), never tensors
    max_queue: int = 1024  # waiting requests beyond this are rejected with 429
    max_batch_tokens: int = 2048  # tokens per iteration per attention worker (chunked prefill budget)
    max_num_seqs: int = 256  # running sequences per attention worker
    microbatch_depth: Literal["auto", "1", "2", "3", "4"] = "auto"
    # aflex: shortest remaining prompt first with aging, prefill capped by the SLOs (the simulator's rule);
    # fcfs: first come first served within max_batch_tokens (the in-process engine's)
    batching: Literal["aflex", "fcfs"] = "aflex"
    heartbeat_timeout_s: float = 5.0
    microbatch_timeout_s: float = 120.0
    # a microbatch sent this long ago that its worker's heartbeat does not list, and that is not done, is lost
    microbatch_lost_after_s: float = 3.0
    # SLOs (vLLM's definitions: TTFT = first token - arrival, TPOT = (last - first) / (n - 1))
    ttft_slo_ms: float = 400.0
    tpot_slo_ms: float = 120.0
    # frequency commands: one per healthy worker every window, valid for three windows
    freq_window_s: float = 2.0
    freq_policy: Literal["aflex", "max", "fixed", "slo"] = "aflex"  # aflex: falls back to slo per worker
    fixed_clocks: str = ""  # for "fixed": e.g. "attention.decode=900,ffn.decode=1200,ffn=1100" (MHz)
    freq_link_gbs: float = 400.0  # aflex: the A/F link bandwidth the predictors assume, GB/s
    freq_observe: bool = True  # aflex: correct the predictors online from MicrobatchDone timings
    telemetry_hz: float = 1.0  # SchedulerTelemetry rate; 0 turns it off


class WorkerSettings(ServiceSettings):
    worker_id: str
    model: str = "default"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    quantize: Literal["none", "int8"] = "none"  # int8: W8A8 projections on the CPU (shared/model/quant.py)
    device: str = "cpu"
    heartbeat_period_s: float = 1.0
    register_timeout_s: float = 60.0
    gpu_backend: str = "auto"  # auto, nvml, nvml-readonly, emulated
    gpu_profile: str = "a800"  # the emulated GPU's profile
    gpu_pace: bool = False  # emulated: sleep for the modelled time of each operator call
    telemetry_hz: float = 10.0  # WorkerTelemetry messages per second (0: none)
    default_clock_mhz: int | None = None  # the clock without a valid command; None: the GPU's maximum
    hysteresis_mhz: int = 30  # the clock switches only for a change larger than this
    min_hold_s: float = 0.2  # and at most once per this many seconds
    torch_threads: int | None = None  # CPU threads for torch; `aflex up` splits the cores among workers
    # seam frames: "lean" = the worker's own lean NATS link (shared/seam_link.py), "nats-py" = its nats-py
    # connection (for a server the lean link does not speak to: TLS, NKey/JWT credentials)
    seam_transport: Literal["lean", "nats-py"] = "lean"


class AttentionWorkerSettings(WorkerSettings):
    worker_id: str = "attn-0"
    num_kv_blocks: int = 2048
    block_size: int = 16
    # One layer's FFN round trip; beyond it the microbatch fails and the scheduler re-runs its
    # sequences (with another FFN worker if this one is gone).
    ffn_reply_timeout_s: float = 30.0
    # an FFN worker with no heartbeat for this long is gone: hops waiting on it fail now (0: off)
    ffn_silence_s: float = 5.0


class FFNWorkerSettings(WorkerSettings):
    worker_id: str = "ffn-0"
    merge_microbatches: bool = True  # stack queued microbatches of one layer into one GEMM
