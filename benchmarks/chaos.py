"""A fault campaign: random kills and hangs while a mixed load runs; every request a whole answer or a typed error.

    python benchmarks/chaos.py --json out/chaos.json                     # 1 + 8 + 1 minutes, seed 1
    python benchmarks/chaos.py --fault-s 600 --fault-gap-s 5 --nats-cluster 3 --seed 7
    python benchmarks/chaos.py --groups --json out/chaos-groups.json     # workers as groups of 2: rank faults too

`aflex up` with 2 attention + 2 FFN workers, 2 gateways and the global scheduler on (P/D pools, a short
provisioning window so plans change under the faults); optionally a 3-node NATS
cluster. The load (tools/chaos/requests.py): streamed and plain chat and completions, greedy and seeded,
n = 2, logprobs, a required tool call, a multi-turn chat whose history is prefix-cached. The faults
(tools/chaos/faults.py): SIGKILL of any worker, the scheduler or a gateway; SIGSTOP for 0-5 s then SIGCONT;
with --groups (every worker a group of 2 ranks: `--attention-tp 2 --ffn-tp 2`, a 3 s group timeout), SIGKILL
or SIGSTOP of a group's rank 1; with --nats-cluster 3,
SIGKILL of a NATS node (started again 1-3 s later); and SIGKILL at moments heard on
NATS (tools/chaos/watch.py): a seam peer mid-hop, a worker mid-KV-handoff, a worker mid-role-change. The
checks and the report:
tools/chaos/campaign.py. Exit status 1 when any request was lost, hung, mismatched or missed its usage.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tools.chaos.campaign import Campaign, Plan
from tools.chaos.faults import Injector
from tools.chaos.watch import Watch
from tools.launch import aflex_up

GROUP_FLAGS = ["--attention-tp", "2", "--ffn-tp", "2"]
GROUP_TIMEOUT_S = "3"  # a paused rank breaks its group's next step after this long


def mesh_args(nats_cluster: int, kinds: str = "pd", groups: bool = False) -> list[str]:
    """P/D pools by default: a prefill and a decode attention worker while all four serve (KV handoffs run all
    the time), a mixed pool while one is lost (each loss and each return is a role change). With `groups`,
    every worker a group of 2 ranks."""
    return ["--attention-workers", "2", "--ffn-workers", "2", "--gateways", "2", "--provisioning", "aflex",
            "--provision-window-s", "5", "--provision-kinds", kinds, *(GROUP_FLAGS if groups else []),
            *(["--nats-cluster", str(nats_cluster)] if nats_cluster > 1 else [])]


def campaign(model: str, plan: Plan, nats_cluster: int = 1, targeted: bool = True, kinds: str = "pd",
             mesh_log: Path | None = None, groups: bool = False) -> dict[str, Any]:
    """Bring the mesh up, run `plan` against it, take it down; the report, with how long each part took."""
    start = time.monotonic()
    env = {"AFLEX_GROUP_TIMEOUT_S": GROUP_TIMEOUT_S} if groups else None
    with aflex_up(model, *mesh_args(nats_cluster, kinds, groups), env_extra=env) as mesh:
        up_s = time.monotonic() - start
        ports = [mesh.port, mesh.port + 1]
        targets = ["attn-0", "attn-1", "ffn-0", "ffn-1", "scheduler", *(f"gateway:{p}" for p in ports)]
        injector = Injector(mesh, targets, random.Random(plan.seed), nats_cluster=nats_cluster > 1,
                            watch=Watch(mesh, "attn-0") if targeted else None,
                            groups={w: 2 for w in targets[:4]} if groups else {})
        campaign = Campaign(plan, [f"http://127.0.0.1:{p}/v1" for p in ports], injector)
        report = asyncio.run(campaign.run())
        crashed = mesh.process.poll()
    if mesh_log is not None:
        mesh_log.write_text(mesh.output())
    report["mesh"] = {"model": model, "args": mesh_args(nats_cluster, kinds, groups), "up_s": round(up_s, 1),
                      "aflex_up_exited": crashed, "wall_s": round(time.monotonic() - start, 1)}
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--standard-s", type=float, default=60.0)
    parser.add_argument("--fault-s", type=float, default=480.0)
    parser.add_argument("--recovery-s", type=float, default=60.0)
    parser.add_argument("--fault-gap-s", type=float, default=4.0, help="mean seconds between faults")
    parser.add_argument("--concurrency", type=int, default=4, help="clients sending at once")
    parser.add_argument("--bound-s", type=float, default=180.0, help="a request not ended by then is hung")
    parser.add_argument("--nats-cluster", type=int, default=1, choices=(1, 3))
    parser.add_argument("--provision-kinds", default="pd", choices=("pd", "auto", "mixed"),
                        help="the pool kinds the global scheduler may plan (aflex up's flag)")
    parser.add_argument("--no-targeted", action="store_true", help="only random kills, hangs and NATS nodes")
    parser.add_argument("--groups", action="store_true",
                        help="every worker a group of 2 ranks, and rank kills and hangs")
    parser.add_argument("--json", type=Path, help="write the report here")
    parser.add_argument("--mesh-log", type=Path, help="write what aflex up printed here")
    args = parser.parse_args()
    plan = Plan(seed=args.seed, standard_s=args.standard_s, fault_s=args.fault_s, recovery_s=args.recovery_s,
                concurrency=args.concurrency, fault_gap_s=args.fault_gap_s, bound_s=args.bound_s)
    report = campaign(args.model, plan, args.nats_cluster, not args.no_targeted, args.provision_kinds, args.mesh_log,
                      args.groups)
    totals, faults = report["totals"], report["faults"]
    print(json.dumps({"totals": totals, "faults": {k: v for k, v in faults.items() if k != "list"},
                      "phases": {name: {k: v for k, v in phase.items() if k != "failures"}
                                 for name, phase in report["phases"].items()}}, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
    broken = sum(totals[k] for k in ("lost", "hung", "mismatched", "bad_usage"))
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
