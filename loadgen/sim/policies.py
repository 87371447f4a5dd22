"""The policies the simulator compares: the paper's baselines, our own reference points, AFlex and its ablations.

Each changes only what its own design changes (placement, scaling, clocks); all share one GPU
profile, one model, one predictor and the serving machinery (`shared.policy.specs`: batching order,
chunking, decode caps, the clock objective; the SLO margin and the provisioning headroom fed back from
the TTFT seen), unless a baseline's own paper says otherwise. The table of what each one is, and of
each exception with its source: docs/evaluation.md, "The policies" and "Fairness". `static-oracle`'s
spec is made in `loadgen.sim.oracle`, with its configuration in it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from shared.policy import AFLEX_BATCHING, SHARED_BATCHING, SHARED_CLOCK_OBJECTIVE, BatchingRule, ClockRule, PoolShape
from shared.policy.footprint import AFLEX_KINDS

PLACEMENTS = ("colocated", "pd", "af")


@dataclass(frozen=True)
class FixedPlan:
    """A static configuration: pool shapes by name ("prefill", "decode" or "mixed")."""

    pools: tuple[tuple[str, PoolShape], ...]


@dataclass(frozen=True)
class PolicySpec:
    name: str
    placement: str  # "colocated" (whole-model instances), "pd" (P/D instance pools), "af" (A/F split)
    clock: ClockRule
    batching: BatchingRule
    scaling: bool = False  # re-provisions every window and parks GPUs outside the plan
    static_plan: str = "peak"  # non-scaling pd/af: "peak" (provision at the peak window, every GPU) or "goodput"
    fixed: FixedPlan | None = None  # the static oracle's configuration
    window_clocks: bool = False  # clocks fixed per window at the plan's operating point (no local DVFS)
    # the plan kinds an A/F policy weighs each window (shared/policy/footprint.py): "pd" pools, one "mixed"
    # split pool, "colocated" replicas, "pd-colocated" pools of replicas (`AFLEX_KINDS`: all but "mixed")
    kinds: tuple[str, ...] = ("pd",)

    @property
    def split(self) -> bool:
        return self.placement == "af"


SHARED = SHARED_BATCHING  # every policy's batching unless its paper says otherwise
# SGLang as it ships (its server defaults: first come first served, a fixed chunked-prefill budget, a decode
# batch cap); also AFlex's `-no-adaptive-batch` ablation
FIXED = BatchingRule(adaptive=False)
# DistServe's prefill instances batch whole prompts first come first served (Zhong et al., OSDI'24, section 4.3)
FCFS = replace(SHARED_BATCHING, order="fcfs")
AFLEX = AFLEX_BATCHING  # the shared machinery and AFlex's per-request decode budget (shared/policy/specs.py)
AFLEX_CLOCK = ClockRule(objective=SHARED_CLOCK_OBJECTIVE)
# one clock for the whole model, chosen per phase and iteration by the shared objective
PHASE_DVFS = ClockRule(per_operator=False, objective=SHARED_CLOCK_OBJECTIVE)
MAX = ClockRule(max_clock=True)

ALIASES = {"colocated-max": "sglang"}


def _specs() -> dict[str, PolicySpec]:
    s = PolicySpec
    return {
        "sglang": s("sglang", "colocated", MAX, FIXED),
        "phase-dvfs": s("phase-dvfs", "colocated", PHASE_DVFS, SHARED),
        # sensitivity only (not a published design): phase-dvfs scoring clocks by energy above the idle floor
        "phase-dvfs-marginal": s("phase-dvfs-marginal", "colocated", ClockRule(per_operator=False,
                                                                                objective="marginal"), SHARED),
        "dynamollm": s("dynamollm", "colocated", PHASE_DVFS, SHARED, scaling=True),
        "distserve": s("distserve", "pd", MAX, FCFS, static_plan="goodput"),
        "biscale": s("biscale", "pd", PHASE_DVFS, SHARED, scaling=True),
        "af-max": s("af-max", "af", ClockRule(max_clock=True, depths=()), SHARED),
        "aflex": s("aflex", "af", AFLEX_CLOCK, AFLEX, scaling=True, kinds=AFLEX_KINDS),
        # ablation: AFlex held to split P/D pools (the footprint before the elastic planner)
        "aflex-pd-only": s("aflex-pd-only", "af", AFLEX_CLOCK, AFLEX, scaling=True),
        "aflex-mixed-only": s("aflex-mixed-only", "af", AFLEX_CLOCK, AFLEX, scaling=True, kinds=("mixed",)),
        "aflex-colocated-only": s("aflex-colocated-only", "af", AFLEX_CLOCK, AFLEX, scaling=True,
                                  kinds=("colocated",)),
        "aflex-pd-colocated-only": s("aflex-pd-colocated-only", "af", AFLEX_CLOCK, AFLEX, scaling=True,
                                     kinds=("pd-colocated",)),
        "aflex-no-opfreq": s("aflex-no-opfreq", "af", ClockRule(per_operator=False, objective=SHARED_CLOCK_OBJECTIVE),
                             AFLEX, scaling=True, kinds=AFLEX_KINDS),
        "aflex-fixed-depth": s("aflex-fixed-depth", "af", ClockRule(depths=(2,), objective=SHARED_CLOCK_OBJECTIVE),
                               AFLEX, scaling=True, kinds=AFLEX_KINDS),
        "aflex-no-adaptive-batch": s("aflex-no-adaptive-batch", "af", AFLEX_CLOCK, replace(FIXED, decode_slack=True),
                                     scaling=True, kinds=AFLEX_KINDS),
        # ablation: AFlex without its per-request decode budget (each iteration held to the step's TPOT budget)
        "aflex-no-decode-slack": s("aflex-no-decode-slack", "af", AFLEX_CLOCK, SHARED, scaling=True, kinds=AFLEX_KINDS),
        # AFlex's global scheduler alone: its pools and base clocks per window, no per-iteration DVFS
        "aflex-global-only": s("aflex-global-only", "af", AFLEX_CLOCK, AFLEX, scaling=True,
                               window_clocks=True, kinds=AFLEX_KINDS),
        # throttLL'eM's "autoscaling alone": DynamoLLM's instance scaling at the top clock
        "dynamollm-no-dvfs": s("dynamollm-no-dvfs", "colocated", MAX, SHARED, scaling=True),
    }


SPECS = _specs()
POLICIES = ("aflex", "sglang", "distserve", "dynamollm", "biscale", "af-max", "phase-dvfs", "aflex-no-opfreq",
            "aflex-fixed-depth", "aflex-no-adaptive-batch", "aflex-no-decode-slack", "aflex-global-only",
            "aflex-pd-only")
ORACLES = ("static-oracle", "pool-oracle")  # searched in hindsight (loadgen.sim.oracle), not specs
PAPER_POLICIES = (*POLICIES, *ORACLES)


def policy_spec(name: str) -> PolicySpec:
    """The spec of `name` (an alias gives the spec under its own name, so reports keep what was asked)."""
    key = ALIASES.get(name, name)
    if key not in SPECS:
        known = ", ".join([*SPECS, *ALIASES, *ORACLES])
        raise ValueError(f"unknown policy {name!r}; known: {known}")
    spec = SPECS[key]
    return spec if key == name else PolicySpec(**{**spec.__dict__, "name": name})
