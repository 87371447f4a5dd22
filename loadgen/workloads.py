"""What to send and when: trace replay, Poisson/gamma arrivals, fixed-length presets.

A workload is a list of `RequestSpec`: an arrival time (seconds after the run starts), the prompt
length and the output length, both in the server's tokens.

- Traces (`--trace conv|code|PATH`): the Azure LLM inference traces (`TIMESTAMP,ContextTokens,
  GeneratedTokens`, CC-BY 4.0, Patel et al., Splitwise, ISCA 2024). Arrival times are kept: the offset
  of each row from the first row of the window, divided by `time_scale` (a speed-up factor: 10 replays
  ten times faster). `window` = (start_s, end_s) in trace seconds from the trace's first row.
  `conv` and `code` are looked up in $AFLEX_TRACES_DIR, else `../shared/traces` next to the repository
  (or `shared/traces` inside it); the simulator's `load_trace` resolves them here too.
- Synthetic arrivals exactly as vLLM's `get_request`: inter-arrival ~ Gamma(shape=burstiness,
  scale=1/(rate*burstiness)) (burstiness 1 = Poisson), cumulated, then rescaled so that the last
  arrival is exactly N/rate; rate inf = everything at t=0; burstiness inf = constant 1/rate.
- Presets of the paper: qa 128/64, chatbot 128/1024, rag 4096/64, summary 4096/1024 (input/output).
"""

from __future__ import annotations

import csv
import math
import os
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np

from shared.errors import AFlexError

PRESETS: dict[str, tuple[int, int]] = {
    "qa": (128, 64),
    "chatbot": (128, 1024),
    "rag": (4096, 64),
    "summary": (4096, 1024),
}
TRACE_NAMES = {"conv": "AzureLLMInferenceTrace_conv.csv", "code": "AzureLLMInferenceTrace_code.csv"}


class WorkloadError(AFlexError):
    """A trace that cannot be read, or workload flags that do not fit together."""


@dataclass(frozen=True)
class RequestSpec:
    index: int
    arrival_s: float  # seconds after the start of the run
    input_len: int
    output_len: int


@dataclass(frozen=True)
class TraceRow:
    offset_s: float  # seconds after the trace's first row
    input_len: int
    output_len: int


class TracesDirNotFoundError(WorkloadError):
    """No directory holds the named traces: $AFLEX_TRACES_DIR is not one, or none is next to the repository."""


def traces_dir() -> Path:
    """Where `conv` and `code` live: $AFLEX_TRACES_DIR, else `shared/traces` beside or inside the repository."""
    env = os.environ.get("AFLEX_TRACES_DIR")
    if env:
        if not Path(env).is_dir():
            raise TracesDirNotFoundError(f"AFLEX_TRACES_DIR={env!r} is not a directory")
        return Path(env)
    repo = Path(__file__).resolve().parents[1]
    candidates = (repo.parent / "shared" / "traces", repo / "shared" / "traces")
    for cand in candidates:
        if cand.is_dir():
            return cand
    looked = ", ".join(str(c) for c in candidates)
    raise TracesDirNotFoundError(f"no traces directory (looked at {looked}; set AFLEX_TRACES_DIR)")


def resolve_trace(spec: str) -> Path:
    """`conv`, `code` or a path to a CSV file."""
    path = traces_dir() / TRACE_NAMES[spec] if spec in TRACE_NAMES else Path(spec)
    if not path.is_file():
        where = " (set AFLEX_TRACES_DIR)" if spec in TRACE_NAMES else ""
        raise WorkloadError(f"trace {spec!r}: no file at {path}{where}")
    return path


def _timestamp(text: str) -> float:
    text = text.strip()
    date, _, frac = text.partition(".")
    try:
        base = datetime.fromisoformat(date)
    except ValueError:
        try:  # a trace may give plain seconds instead of datetimes
            return float(text)
        except ValueError:
            raise WorkloadError(f"bad TIMESTAMP {text!r}") from None
    # Python's fromisoformat takes at most 6 fractional digits; the Azure traces have 7.
    return base.timestamp() + (float("0." + frac) if frac else 0.0)


def read_trace(path: str | Path) -> list[TraceRow]:
    """Rows of an Azure-format trace, offsets from the first row, sorted by time."""
    path = Path(path)
    try:
        with path.open(newline="") as f:
            reader = csv.DictReader(f)
            need = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"}
            if not reader.fieldnames or not need <= set(reader.fieldnames):
                raise WorkloadError(f"{path}: expected columns {sorted(need)}, got {reader.fieldnames}")
            raw = [(_timestamp(r["TIMESTAMP"]), int(r["ContextTokens"]), int(r["GeneratedTokens"])) for r in reader]
    except OSError as exc:
        raise WorkloadError(f"cannot read trace {path}: {exc}") from None
    except (ValueError, TypeError) as exc:
        raise WorkloadError(f"{path}: malformed row: {exc}") from None
    if not raw:
        raise WorkloadError(f"{path}: the trace has no rows")
    raw.sort(key=lambda r: r[0])
    t0 = raw[0][0]
    return [TraceRow(t - t0, i, o) for t, i, o in raw]


def parse_window(text: str | None) -> tuple[float, float]:
    """`START:END` in seconds, either side may be empty: `60:120`, `:300`, `600:`."""
    if not text:
        return 0.0, math.inf
    start, sep, end = text.partition(":")
    if not sep:
        raise WorkloadError(f"--window must be START:END in seconds, got {text!r}")
    try:
        lo = float(start) if start.strip() else 0.0
        hi = float(end) if end.strip() else math.inf
    except ValueError:
        raise WorkloadError(f"--window must be START:END in seconds, got {text!r}") from None
    if lo < 0 or hi <= lo:
        raise WorkloadError(f"--window needs 0 <= START < END, got {text!r}")
    return lo, hi


def trace_workload(rows: list[TraceRow], *, window: tuple[float, float] = (0.0, math.inf), time_scale: float = 1.0,
                   num_prompts: int | None = None, max_input_len: int | None = None,
                   max_output_len: int | None = None) -> list[RequestSpec]:
    """Rows whose offset lies in [start, end), arrivals relative to `start`, divided by `time_scale`."""
    if time_scale <= 0:
        raise WorkloadError(f"--time-scale must be positive, got {time_scale}")
    start, end = window
    chosen = [r for r in rows if start <= r.offset_s < end]
    if num_prompts is not None:
        chosen = chosen[:num_prompts]
    if not chosen:
        raise WorkloadError(f"no trace rows in the window {start:g}:{end:g} s")
    return [RequestSpec(i, (r.offset_s - start) / time_scale, _clip(max(r.input_len, 1), max_input_len),
                        _clip(max(r.output_len, 1), max_output_len)) for i, r in enumerate(chosen)]


def _clip(value: int, limit: int | None) -> int:
    return value if limit is None else min(value, limit)


def arrival_times(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """vLLM's arrival process (see the module docstring); deterministic for a seed."""
    if n <= 0:
        return []
    if rate <= 0 or burstiness <= 0:
        raise WorkloadError("--rate and --burstiness must be positive")
    if math.isinf(rate):
        return [0.0] * n
    if math.isinf(burstiness):
        delays = np.full(n, 1.0 / rate)
    else:
        rng = np.random.default_rng(seed)
        delays = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    cumulative = np.cumsum(delays)
    if cumulative[-1] != 0:
        cumulative *= (n / rate) / cumulative[-1]
    return [float(t) for t in cumulative]


def synthetic_workload(n: int, input_len: int, output_len: int, *, rate: float = math.inf, burstiness: float = 1.0,
                       seed: int = 0) -> list[RequestSpec]:
    if input_len < 1 or output_len < 1:
        raise WorkloadError("--input-len and --output-len must be at least 1")
    return [RequestSpec(i, t, input_len, output_len)
            for i, t in enumerate(arrival_times(n, rate, burstiness, seed))]


def with_arrivals(specs: list[RequestSpec], rate: float, burstiness: float, seed: int) -> list[RequestSpec]:
    """A trace's lengths with synthetic arrivals instead of its own."""
    times = arrival_times(len(specs), rate, burstiness, seed)
    return [RequestSpec(s.index, t, s.input_len, s.output_len) for s, t in zip(specs, times, strict=True)]
