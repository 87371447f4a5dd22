"""The global scheduler, live: every provisioning window, the simulator's planning call over the live workers.

Pure (no I/O, no clock of its own): dispatch tells it what it admitted and what finished, and asks it
for a plan with the workers it has; it answers each worker's assignment. The decisions are
shared/policy's: the window's load (`window_load`, the simulator's rule: the burst quantile of
30-second rates), the cluster (`ClusterSpec.for_model`, limited to the halves the workers loaded)
and the plan (`elastic_plan`, the call the simulator's AFlex planner makes, at the headroom the
last window's P90 TTFT corrects: `AdaptiveHeadroom`). Only the mapping of a
plan's pools onto named workers is this module's: a worker keeps its role where the plan allows, so a
plan moves as few workers as it can.

Kinds live: a mesh whose workers each load one half serves "mixed" pools (every attention worker runs
prefill and decode beside the FFN workers) and "pd" pools (prefill and decode attention workers, each
pool with FFN workers of its own, sequences moving between them by KV handoff: handoff.py); which of
them a window may use is the caller's (`provision_kinds`). "colocated" pools are whole-model replicas on
attention workers that loaded both halves (`colocate`), one worker each; the FFN workers park. A
"pd-colocated" plan puts such replicas in a prefill pool and a decode pool (`prefill-colocated`,
`decode-colocated`), each at its own clocks, the KV handed from one to the other as between split pools.

A worker may be a group of devices (`--attention-tp`, `--ffn-tp`, `--ffn-ep`): the cluster is then the groups'
devices, and the plan may use only groups the mesh has (`LiveGroups`): a split pool's attention GPUs in groups
of its attention workers' size, its FFN GPUs what some FFN workers hold together, colocated replicas of the
whole-model workers' sizes. The simulator makes the same call on a cluster free to form any group the model
splits over, so where the live mesh was started with the groups the simulator plans, the two plans are one
(tests/services/scheduler/test_group_plans.py). Groups are formed at start, as vLLM's `--tensor-parallel-size`
is: the live planner picks among them and parks the rest, it does not re-form them.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import numpy as np

from services.scheduler.power_books import LivePowerCorrection
from shared.gpu.emulated import GPUProfile
from shared.kinds import PARKED, PARKED_ASSIGNMENT, PLAN_KINDS, Assignment, ParkingChoice
from shared.model.config import ModelArgs
from shared.perf import Predictor
from shared.policy import ClockRule, ClusterSpec, Plan, WindowLoad
from shared.policy.footprint import weigh_kinds
from shared.policy.headroom import AdaptiveHeadroom
from shared.policy.parking_rule import model_parking_state, parked_power_w, parking_state
from shared.policy.pool_sizing import LiveGroups
from shared.policy.window_load import window_load

POOL_ASSIGNMENT: dict[str, Assignment] = {"prefill": "prefill-attention", "decode": "decode-attention",
                                          "mixed": "mixed-attention", "colocated": "colocated"}
# a pool of whole-model replicas: its workers run the FFN half themselves
COLOCATED_ASSIGNMENT: dict[str, Assignment] = {"prefill": "prefill-colocated", "decode": "decode-colocated",
                                               "colocated": "colocated"}


@dataclass
class Arrival:
    request_id: str
    mono: float
    prompt_tokens: int
    max_tokens: int
    output_tokens: int | None = None  # known once it finished


class LoadLog:
    """The requests admitted over the last `keep_s` seconds, with their output lengths once known."""

    def __init__(self, keep_s: float) -> None:
        self.keep_s = keep_s
        self.arrivals: deque[Arrival] = deque()
        self.by_id: dict[str, Arrival] = {}

    def admitted(self, request_id: str, mono: float, prompt_tokens: int, max_tokens: int) -> None:
        arrival = Arrival(request_id, mono, prompt_tokens, max_tokens)
        self.arrivals.append(arrival)
        self.by_id[request_id] = arrival

    def finished(self, request_id: str, output_tokens: int) -> None:
        arrival = self.by_id.pop(request_id, None)
        if arrival is not None:
            arrival.output_tokens = output_tokens

    def prune(self, now_mono: float, keep_s: float | None = None) -> None:
        keep_s = max(self.keep_s, keep_s or 0.0)
        while self.arrivals and now_mono - self.arrivals[0].mono > keep_s:
            self.by_id.pop(self.arrivals.popleft().request_id, None)

    def load(self, now_mono: float, window_s: float, subwindow_s: float, quantile: float) -> WindowLoad:
        """The load of the last `window_s` seconds, by the simulator's rule. A request still running counts
        the mean output of those that finished (its `max_tokens` while none has)."""
        self.prune(now_mono, window_s)
        t0 = now_mono - window_s
        recent = [a for a in self.arrivals if a.mono >= t0]
        done = [a.output_tokens for a in recent if a.output_tokens is not None]
        mean_out = sum(done) / len(done) if done else None
        outputs = [a.output_tokens if a.output_tokens is not None else
                   (mean_out if mean_out is not None else a.max_tokens) for a in recent]
        return window_load([a.mono - t0 for a in recent], [a.prompt_tokens for a in recent], outputs, 0.0,
                           window_s, burst=True, subwindow_s=subwindow_s, quantile=quantile)


@dataclass(frozen=True)
class PlanDecision:
    plan_id: int
    plan: Plan
    load: WindowLoad
    assignments: dict[str, Assignment]
    changed: list[str]
    pool_of: dict[str, str] = field(default_factory=dict)  # worker -> the pool it serves in ("" when parked)
    power_factor: dict[str, float] | None = None  # each kind's power correction it was ranked with
    weighed: dict[str, Plan] = field(default_factory=dict)  # each kind's best plan, which this one was chosen from


@dataclass(frozen=True)
class Observed:
    """What a window reads on the event loop (where dispatch adds to it) for a plan made elsewhere."""

    load: WindowLoad  # the last window's
    p90_ttft_ms: float | None  # the last window's first tokens'
    stretch_load: WindowLoad | None  # the load since the plan in force began (its power correction's)
    # the P90 TPOT of the requests that came since the plan in force began and finished, within the SLO (None:
    # none finished, or the stretch is shorter than a verdict needs)
    stretch_tpot_met: bool | None = None


def assign(plan: Plan, attention_ids: list[str], ffn_ids: list[str], previous: dict[str, Assignment],
           parked: Assignment = PARKED_ASSIGNMENT["warm"], previous_pool: dict[str, str] | None = None,
           colocate_ids: list[str] | None = None, sizes: Mapping[str, int] | None = None
           ) -> tuple[dict[str, Assignment], dict[str, str]]:
    """Name the workers of each pool of `plan`, moving as few as it can: first every worker keeps its place
    where the plan still has one (its role, and an FFN worker its pool); then the places left take the
    serving workers that lost theirs, then parked ones (warm before cold), each in id order; the rest park
    (`parked`). So a pool that grows wakes a parked worker rather than taking one from another pool, whose
    sequences would have to move. A colocated pool's replicas are attention workers that hold both halves
    (`colocate_ids`; None: every attention worker). A worker is a group of `sizes[id]` GPUs (absent: one): a
    place of N GPUs takes groups of its size (a pool's attention TP, a replica's TP) until they hold N; an
    FFN place takes FFN workers that fit what it still needs."""
    before = previous_pool or {}
    size_of = sizes or {}
    places: list[tuple[str, Assignment, int, list[str]]] = []  # (pool, role, GPUs it takes, candidates)
    whole = set(attention_ids if colocate_ids is None else colocate_ids)
    for pool, shape in plan.pools().items():
        if not shape.split:  # whole-model replicas: one colocated pool, or a P/D plan's prefill or decode pool
            places.append((pool, COLOCATED_ASSIGNMENT[pool], shape.gpus,
                           [w for w in sorted(attention_ids) if w in whole and size_of.get(w, 1) == shape.tp]))
            continue
        tp = max(1, shape.attention_tp)
        places.append((pool, POOL_ASSIGNMENT[pool], shape.attention,
                       [w for w in sorted(attention_ids) if size_of.get(w, 1) == tp]))
        places.append((pool, "ffn", shape.ffn, sorted(ffn_ids)))
    out: dict[str, Assignment] = {}
    pool_of: dict[str, str] = {}
    left = [gpus for _, _, gpus, _ in places]

    def fill(i: int, wids: list[str]) -> None:
        """Give place `i` the free workers of `wids`, in order, while their devices fit what it still takes."""
        pool, role, _, _ = places[i]
        for wid in wids:
            if wid not in out and size_of.get(wid, 1) <= left[i]:
                out[wid], pool_of[wid] = role, pool
                left[i] -= size_of.get(wid, 1)

    def rank(wid: str) -> tuple[bool, bool, str]:
        was = previous.get(wid, PARKED_ASSIGNMENT["warm"])
        return was in PARKED, was == PARKED_ASSIGNMENT["cold"], wid

    for i, (pool, role, _, candidates) in enumerate(places):  # first: who keeps its place
        fill(i, [w for w in candidates if previous.get(w) == role and before.get(w, pool) == pool])
    for i, (_, _, _, candidates) in enumerate(places):
        fill(i, sorted(candidates, key=rank))
    for wid in [*attention_ids, *ffn_ids]:
        if wid not in out:
            out[wid], pool_of[wid] = parked, ""
    return out, pool_of


class Provisioner:
    """The live global scheduler's state: the load it saw, the assignments it gave, the plans it made."""

    def __init__(self, *, window_s: float, ttft_slo_ms: float, tpot_slo_ms: float, link_bytes_s: float,
                 headroom: float = 1.3, min_attention: int = 1, min_ffn: int = 1, subwindow_s: float = 30.0,
                 quantile: float = 0.9, kinds: tuple[str, ...] = PLAN_KINDS, parking: ParkingChoice = "auto") -> None:
        if window_s <= 0:
            raise ValueError(f"provision_window_s must be > 0, got {window_s}")
        if min_attention < 1 or min_ffn < 1:
            raise ValueError(f"a mesh serves with at least one attention and one FFN worker, got "
                             f"provision_min_attention={min_attention}, provision_min_ffn={min_ffn}")
        self.window_s = window_s
        self.headroom_rule = AdaptiveHeadroom(headroom)  # the simulator's AFlex rule, fed each window's TTFT
        self.ttft_slo_ms = ttft_slo_ms
        self.ttfts: deque[tuple[float, float]] = deque()  # (monotonic time of a first token, TTFT ms)
        self.tpots: deque[tuple[float, float, float]] = deque()  # (finished, arrived: monotonic s; TPOT s)
        self.ttft_slo_s, self.tpot_slo_s, self.link_bytes_s = ttft_slo_ms / 1e3, tpot_slo_ms / 1e3, link_bytes_s
        self.min_attention, self.min_ffn = min_attention, min_ffn
        self.subwindow_s = min(subwindow_s, window_s / 2)  # a short (test) window still sees its bursts
        self.quantile, self.kinds = quantile, kinds
        parking_state(parking, 0.0, 0.0, 0.0, 0.0)  # an unknown state is refused now, not at the first plan
        self.parking = parking
        self.power = LivePowerCorrection(window_s)
        self.loads = LoadLog(keep_s=max(window_s, self.power.correction.min_span_s))  # a stretch's load too
        self.observed_mono: float | None = None  # when the last window's load was read
        self.assignments: dict[str, Assignment] = {}
        self.plan_id = 0
        self.kind: str | None = None
        self.latest: PlanDecision | None = None

    def first_token(self, mono: float, ttft_ms: float) -> None:
        self.ttfts.append((mono, ttft_ms))

    def finished_tpot(self, now_mono: float, arrived_mono: float, tpot_s: float) -> None:
        """A request finished with this TPOT: the stretch it came in is judged by it (`stretch_tpot_met`)."""
        self.tpots.append((now_mono, arrived_mono, tpot_s))
        while self.tpots and now_mono - self.tpots[0][0] > 2 * self.window_s:
            self.tpots.popleft()

    def stretch_tpot_met(self, now_mono: float) -> bool | None:
        """Whether the requests that came since the plan in force began met the P90 TPOT SLO (None: too short a
        stretch for a verdict, or none of them finished). The simulator's rule
        (`loadgen.sim.slo_window.stretch_tpot_met`)."""
        s = self.power.stretch
        if s is None or now_mono - s.since_mono < self.power.correction.min_span_s:
            return None
        tpots = [t for _, arrived, t in self.tpots if arrived >= s.since_mono]
        return None if not tpots else bool(np.percentile(tpots, 90) <= self.tpot_slo_s)

    def p90_ttft_ms(self, now_mono: float) -> float | None:
        """The P90 TTFT of the first tokens of the last window (None: none)."""
        while self.ttfts and now_mono - self.ttfts[0][0] > self.window_s:
            self.ttfts.popleft()
        return float(np.percentile([ms for _, ms in self.ttfts], 90)) if self.ttfts else None

    def parked_state(self, args: ModelArgs, profile: GPUProfile) -> Assignment:
        """Where a worker out of the plan waits, by the simulator's rule (`parking_state`): cold when the power
        it saves over the window it is expected out pays for the model load (context-idle power over
        `cold_rejoin_s` of one role's weights) that brings it back."""
        return PARKED_ASSIGNMENT[model_parking_state(self.parking, profile, args, self.window_s)]

    def spec(self, args: ModelArgs, profile: GPUProfile, groups: LiveGroups, gpu_memory_bytes: float = 0.0
             ) -> ClusterSpec:
        """The live cluster: its workers' devices as GPUs of `gpu_memory_bytes` (0: the profile's), planned only as
        the groups the workers are (`LiveGroups`), a parked one priced at its parking state's power."""
        parked_w = parked_power_w(model_parking_state(self.parking, profile, args, self.window_s), profile)
        return ClusterSpec.for_model(args, groups.gpus, ttft_slo_s=self.ttft_slo_s, tpot_slo_s=self.tpot_slo_s,
                                     link_bytes_s=self.link_bytes_s, parked_power_w=parked_w, groups=groups,
                                     gpu_memory_bytes=gpu_memory_bytes or profile.memory_bytes)

    def observe(self, now_mono: float) -> Observed:
        """The last window's load and P90 TTFT, and the load since the plan in force began: read where
        dispatch adds to them (the event loop), so that `plan` may run elsewhere (a thread: its first call
        builds the predictors' tables, seconds)."""
        # windows follow each other as the simulator's do: one starts where the last ended, so no arrival is
        # missed when the wait and the planning call together outlast `window_s`
        span_s = self.window_s if self.observed_mono is None else max(self.window_s, now_mono - self.observed_mono)
        self.observed_mono = now_mono
        stretch = self.power.stretch
        stretch_load = None if stretch is None else self.loads.load(
            now_mono, max(self.window_s, now_mono - stretch.since_mono), self.subwindow_s, self.quantile)
        return Observed(self.loads.load(now_mono, span_s, self.subwindow_s, self.quantile),
                        self.p90_ttft_ms(now_mono), stretch_load, self.stretch_tpot_met(now_mono))

    def plan(self, now_mono: float, pred: Predictor, rule: ClockRule, attention_ids: list[str],
             ffn_ids: list[str], kinds: tuple[str, ...] | None = None,
             observed: Observed | None = None, colocate_ids: list[str] | None = None,
             gpu_memory_bytes: float = 0.0, sizes: Mapping[str, int] | None = None) -> PlanDecision:
        """The plan for the coming window over these (healthy, registered) workers, and who serves where;
        `kinds`: the pool kinds it may use (None: the provisioner's); `observed`: `observe`'s (None: read now);
        `colocate_ids`: the attention workers that hold both halves (None: none); `gpu_memory_bytes`: the
        smallest of the workers' GPUs (0: the profile's); `sizes`: each worker's devices (absent: one)."""
        whole = [w for w in colocate_ids or () if w in attention_ids]
        if not attention_ids or not (ffn_ids or whole):
            raise ValueError("a plan needs an attention and an FFN worker, or an attention worker holding both halves")
        seen = observed if observed is not None else self.observe(now_mono)
        load = seen.load
        size_of = sizes or {}
        groups = LiveGroups(tuple(size_of.get(w, 1) for w in attention_ids), tuple(size_of.get(w, 1) for w in ffn_ids),
                            tuple(size_of.get(w, 1) for w in whole))
        spec = self.spec(pred.args, pred.profile, groups, gpu_memory_bytes)
        headroom = self.headroom_rule.update(seen.p90_ttft_ms, self.ttft_slo_ms)
        kinds = kinds or self.kinds
        stretch = self.power.stretch
        if seen.stretch_load is not None and stretch is not None and seen.stretch_tpot_met is not None \
                and self.latest is not None:  # a kind that missed TPOT is not returned to at that load or above
            self.power.correction.judged(stretch.plan.kind, seen.stretch_tpot_met, seen.stretch_load.rate_rps,
                                         planned_rps=self.latest.load.rate_rps)
        if seen.stretch_load is not None:  # what the plan in force drew, against its model: its kind's factor
            met = seen.p90_ttft_ms is None or seen.p90_ttft_ms <= self.ttft_slo_ms
            self.power.observe(now_mono, pred, rule, seen.stretch_load, met)
        factor = self.power.factors(kinds)
        barred = self.power.correction.barred(kinds, load.rate_rps)
        try:
            plan, weighed = weigh_kinds(pred, load, spec, rule, headroom, self.kind, kinds=kinds, power_factor=factor,
                                        barred=barred)
        except ValueError:  # no plan of these kinds fits (e.g. colocated, where no worker holds the whole model)
            if kinds == ("mixed",) or not ffn_ids:
                raise
            plan, weighed = weigh_kinds(pred, load, spec, rule, headroom, self.kind, kinds=("mixed",))
        plan = self._at_least(plan, spec)
        assignments, pool_of = assign(plan, attention_ids, ffn_ids, self.assignments,
                                      self.parked_state(pred.args, pred.profile),
                                      self.latest.pool_of if self.latest is not None else None, whole, size_of)
        changed = sorted(w for w, a in assignments.items() if self.assignments.get(w) != a)
        self.plan_id += 1
        self.kind, self.assignments = plan.kind, assignments
        self.power.applied(now_mono, plan, spec)
        self.latest = PlanDecision(self.plan_id, plan, load, assignments, changed, pool_of, factor, weighed)
        return self.latest

    def _at_least(self, plan: Plan, spec: ClusterSpec) -> Plan:
        """The operator's floor: a mixed plan grown to `min_attention` and `min_ffn` serving workers where
        the mesh has them (the grown GPUs are priced as serving idle, not as parked; workers as the smallest
        groups of their role)."""
        pool = plan.mixed
        if pool is None or not pool.split:
            return plan
        a = min(max(pool.attention, self.min_attention * spec.least_attention_tp), spec.max_attention or math.inf)
        f = min(max(pool.ffn, self.min_ffn * min(spec.ffn_sizes or (1,))), spec.max_ffn or math.inf)
        f = min((s for s in spec.ffn_sizes or (f,) if s >= f), default=f)
        if (a, f) == (pool.attention, pool.ffn):
            return plan
        grown = replace(pool, attention=int(a), ffn=int(f))
        return replace(plan, mixed=grown, parked=spec.gpus - grown.gpus)

    def forget(self, worker_id: str) -> None:
        """A worker gone (lost or deregistered): its assignment no longer holds."""
        self.assignments.pop(worker_id, None)
