"""What each policy's global controller plans: pool shapes for the coming window, from the load it saw.

The simulator asks `SimPlanner.plan` at the start (the trace's first minute, or its peak window for
a static policy) and every `window_s` (and at a 30-second tick when the recent rate outgrows the
plan by 20%) for a scaling policy. The decisions are shared/policy's (`provision`, `placement`);
this module only turns the trace into `WindowLoad`s and a policy's placement into the call it makes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property

import numpy as np

from loadgen.sim.arrivals import Arrivals
from loadgen.sim.policies import PolicySpec
from shared.perf import Predictor
from shared.policy import ClockRule, ClusterSpec, PoolShape, WindowLoad, provision
from shared.policy.baseline_placement import distserve_placement, provision_pd
from shared.policy.colocated import colocated_tp, instance_pool, provision_colocated
from shared.policy.footprint import smallest_pd_gpus, weigh_kinds
from shared.policy.pool_sizing import Plan, decode_point, prefill_point
from shared.policy.power_correction import PowerCorrection
from shared.policy.window_load import window_load

Shapes = dict[str, PoolShape]


@dataclass
class SimPlanner:
    policy: PolicySpec
    spec: ClusterSpec
    pred: Predictor
    arrivals: Arrivals
    window_s: float
    headroom: float
    burst_subwindow_s: float
    burst_quantile: float
    colocated_tp: int | None = None
    placement_note: str = ""  # how a static placement was chosen (reported)
    last_load: WindowLoad | None = None  # the load the latest plan was made for
    kind: str | None = None  # the latest plan's kind ("pd", "mixed", "colocated", "pd-colocated"; `Plan.kind`)
    last_plan: Plan | None = None  # the latest plan a scaling policy's search returned (its predicted power)
    correction: PowerCorrection | None = None  # AFlex: each kind's power corrected by what its plans drew
    last_weighed: dict[str, float] = field(default_factory=dict)  # the kinds the latest plan was chosen from (W)

    def load(self, t0: float, t1: float, burst: bool = False) -> WindowLoad:
        """The load of [t0, t1): mean rate, or with `burst` the `burst_quantile` of its sub-window rates
        (the global controller provisions for the bursts it saw, not their average)."""
        a = self.arrivals
        idle_prompt, idle_output = self._idle_lengths
        return window_load(a.time_s, a.prompt, a.output, t0, t1, burst=burst, subwindow_s=self.burst_subwindow_s,
                           quantile=self.burst_quantile, idle_prompt=idle_prompt, idle_output=idle_output)

    @cached_property
    def _idle_lengths(self) -> tuple[float, float]:
        """The prompt and output lengths a window without arrivals is planned with: the trace's means."""
        a = self.arrivals
        return (float(np.mean(a.prompt)), float(np.mean(a.output))) if len(a) else (1.0, 1.0)

    def peak_load(self, burst: bool = False) -> WindowLoad:
        """The busiest `window_s` window of the trace (what a static deployment is sized for); with `burst`,
        each window's load is the burst-aware one the scaling planners provision for (`load`)."""
        a = self.arrivals
        end = float(a.time_s[-1]) if len(a) else 1.0
        best = self.load(0, min(end + 1e-6, self.window_s), burst)
        t = 0.0
        while t < end:
            w = self.load(t, t + self.window_s, burst)
            if w.rate_rps > best.rate_rps:
                best = w
            t += self.window_s
        return best

    def initial(self) -> Shapes:
        """The plan at time 0: a static policy's for the whole trace, a scaling one's for its first minute."""
        if self.policy.fixed is not None:
            return dict(self.policy.fixed.pools)
        if not self.policy.scaling:
            return self.static()
        end = float(self.arrivals.time_s[-1]) if len(self.arrivals) else 0.0
        return self.window(self.load(0.0, min(60.0, end + 1e-6), burst=True))

    def static(self) -> Shapes:
        n, pol = self.spec.gpus, self.policy
        if pol.placement == "colocated":
            p90 = float(np.percentile(self.arrivals.prompt, 90)) if len(self.arrivals) else 0.0
            tp = self.colocated_tp or colocated_tp(self.pred, self.spec, p90)
            self.placement_note = f"{n // tp} x TP{tp}, smallest TP that fits the p90 prompt ({p90:.0f} tokens)"
            return {"colocated": instance_pool(n // tp, tp, self.spec)}
        peak = self.peak_load()
        if pol.placement == "pd" and pol.static_plan == "goodput":
            # sized, as its search sizes for SLO attainment on the arrivals themselves, for the bursts in them,
            # to the rate itself (its Algorithm 1 replicates up to the rate; the burst quantile is the margin)
            peak = self.peak_load(burst=True)
            g = distserve_placement(self.pred, peak, self.spec, pol.clock, headroom=1.0)
            how = ("per phase the fewest instances (of the TP needing the fewest GPUs) that hold the busiest "
                   "window's burst load" if g.sized else
                   "nothing smaller holds the load: goodput-optimal over every all-GPU P/D placement")
            self.placement_note = f"{how}: holds {g.load_multiple:.2f}x it ({peak.rate_rps:.2f} req/s)"
            return {"prefill": g.prefill, "decode": g.decode}
        if pol.placement == "pd":
            plan = provision_pd(self.pred, peak, self.spec, pol.clock, self.headroom, use_all=True)
        else:  # MegaScale-Infer-style plan search at the trace's peak 5-minute load, every GPU used
            plan = provision(self.pred, peak, self.spec, pol.clock, headroom=self.headroom, use_all=True)
        return self._shapes(plan)

    def window(self, load: WindowLoad, same_kind: bool = False) -> Shapes:
        """A scaling policy's plan for `load`; `same_kind`: of the current plan's kind (a tick between
        windows grows pools, it does not drain them)."""
        pol = self.policy
        self.last_load = load
        if pol.placement == "colocated":
            return self._shapes(provision_colocated(self.pred, load, self.spec, pol.clock, self.headroom))
        if pol.placement == "pd":
            return self._shapes(provision_pd(self.pred, load, self.spec, pol.clock, self.headroom))
        if pol.kinds != ("pd",):
            kinds = (self.kind,) if same_kind and self.kind in pol.kinds else pol.kinds
            factor = self.correction.factors(kinds) if self.correction is not None else None
            barred = self.correction.barred(kinds, load.rate_rps) if self.correction is not None else frozenset()
            plan, weighed = weigh_kinds(self.pred, load, self.spec, pol.clock, self.headroom, self.kind, kinds=kinds,
                                        power_factor=factor, barred=barred)
            self.last_weighed = {kind: round(p.predicted_power_w, 1) for kind, p in weighed.items()}
            return self._shapes(plan)
        return self._shapes(provision(self.pred, load, self.spec, pol.clock, headroom=self.headroom,
                                      min_pd_gpus=smallest_pd_gpus(self.spec)))  # P/D from 4 GPUs, as live

    def _shapes(self, plan: Plan) -> Shapes:
        self.kind = plan.kind
        self.last_plan = plan
        return plan.pools()

    def window_rule(self, mode: str, shape: PoolShape) -> ClockRule:
        """The global scheduler alone: the pool's clocks fixed for the window at the operating points its
        plan was sized with (the load × headroom), so no iteration picks its own."""
        load = self.last_load or self.peak_load()
        hl = WindowLoad(load.rate_rps * self.headroom, load.mean_prompt, load.mean_output, load.p90_prompt)
        rule = replace(self.policy.clock, objective="total")
        top = float(self.pred.profile.max_mhz)
        pre = dec = (top, top)
        if mode in ("prefill", "mixed", "colocated"):
            op, _, _ = prefill_point(self.pred, shape, hl, self.spec, rule)
            pre = (op.clock_attention, op.clock_ffn) if op is not None else pre
        if mode in ("decode", "mixed", "colocated"):
            op_d, _ = decode_point(self.pred, shape, hl, self.spec, rule)
            dec = (op_d.clock_attention, op_d.clock_ffn) if op_d.feasible else dec
        return replace(self.policy.clock, fixed_mhz=(pre, dec))

