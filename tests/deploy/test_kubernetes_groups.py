"""Worker groups across hosts on Kubernetes: `attention.multiHost` / `ffn.multiHost` render a LeaderWorkerSet.

A group larger than a node's GPUs runs a pod a rank (LeaderWorkerSet, https://lws.sigs.k8s.io): the leader pod
is rank 0, the group's face on NATS, with its store on `groupPort`; the worker pods are ranks 1..N-1, which the
LWS controller numbers (`LWS_WORKER_INDEX`) and points at the leader (`LWS_LEADER_ADDRESS`). The objects are
checked against LWS's own schema and each pod template as a Pod (tests/deploy/chart.py's `validate`), and the
env each pod gets, with the controller's variables put in, parses into the worker's settings as a rank's.
"""

from __future__ import annotations

import copy
import os
import re

import jsonschema
import kubernetes_validate
import pytest

from shared import settings as settings_module
from tests.deploy.chart import GPU, KUBE_VERSIONS, by_kind, env_of, example, literal, merged, render, validate

MULTI_HOST = {"attention": {"tp": 2, "multiHost": True}, "ffn": {"tp": 2, "ep": 2, "multiHost": True}}


def _settings(container: dict, lws: dict[str, str], monkeypatch: pytest.MonkeyPatch, cls: type) -> object:
    """`cls` from the container's env as the pod would get it: LWS's variables first, `$(VAR)` expanded."""
    for name in list(os.environ):
        if name.startswith("AFLEX_"):
            monkeypatch.delenv(name)
    with monkeypatch.context() as patch:
        for name, entry in env_of(container).items():
            if name.startswith("AFLEX_"):
                value = str(entry["value"]) if "value" in entry else ("10.0.0.7" if "HOST" in name else "4")
                patch.setenv(name, re.sub(r"\$\((\w+)\)", lambda m: lws[m[1]], value))
        return cls()


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
def test_a_multi_host_group_is_a_leader_worker_set_of_one_gpu_pods(kube_version: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    docs = render(merged(example("gpu"), MULTI_HOST))
    for doc in docs:
        validate(doc, kube_version)
    sets = by_kind(docs, "LeaderWorkerSet")
    assert set(sets) == {"aflex-attn", "aflex-ffn"} and not set(by_kind(docs, "StatefulSet")) & set(sets)
    for name, ranks, cls in (("aflex-attn", 2, settings_module.AttentionWorkerSettings),
                             ("aflex-ffn", 4, settings_module.FFNWorkerSettings)):
        spec = sets[name]["spec"]
        template = spec["leaderWorkerTemplate"]
        assert template["size"] == ranks and template["restartPolicy"] == "RecreateGroupOnPodRestart"
        (leader,) = template["leaderTemplate"]["spec"]["containers"]
        (follower,) = template["workerTemplate"]["spec"]["containers"]
        for container in (leader, follower):  # a GPU a pod
            assert container["resources"]["limits"][GPU] == container["resources"]["requests"][GPU] == 1
        lws = {"LWS_LEADER_ADDRESS": f"{name}-0.{name}.aflex", "LWS_WORKER_INDEX": "0", "LWS_GROUP_SIZE": str(ranks)}
        rank0 = _settings(leader, lws, monkeypatch, cls)
        assert (rank0.group_rank, rank0.group_spawn, rank0.group_port, rank0.group_size) == (0, False, 29500, ranks)
        assert "livenessProbe" in leader and "livenessProbe" not in follower  # a follower has no NATS presence
        rank3 = _settings(follower, {**lws, "LWS_WORKER_INDEX": str(ranks - 1)}, monkeypatch, cls)
        assert rank3.group_rank == ranks - 1 and rank3.group_size == ranks
        assert rank3.group_address == f"gloo://{name}-0.{name}.aflex:29500"
        assert literal(env_of(follower), "AFLEX_GROUP_RANK") == "$(LWS_WORKER_INDEX)"


def test_a_group_of_one_rank_stays_a_stateful_set() -> None:
    docs = render(merged(example("gpu"), {"attention": {"tp": 1, "multiHost": True}}))
    assert "aflex-attn" in by_kind(docs, "StatefulSet") and not by_kind(docs, "LeaderWorkerSet")


def test_the_leader_worker_set_check_is_strict() -> None:
    """A misspelt LWS field, or a bad pod in it, fails: the check above is not vacuous."""
    (lws,) = [d for d in render(merged(example("gpu"), MULTI_HOST)) if d["metadata"]["name"] == "aflex-attn"
              and d["kind"] == "LeaderWorkerSet"]
    misspelt = copy.deepcopy(lws)
    misspelt["spec"]["leaderWorkerTemplate"]["restartPolicie"] = "None"
    with pytest.raises(jsonschema.ValidationError):
        validate(misspelt, KUBE_VERSIONS[-1])
    bad_pod = copy.deepcopy(lws)
    bad_pod["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["terminationGracePeriodSeconds"] = "330s"
    with pytest.raises((jsonschema.ValidationError, kubernetes_validate.ValidationError), match="330s"):
        validate(bad_pod, KUBE_VERSIONS[-1])
