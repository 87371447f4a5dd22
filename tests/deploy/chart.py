"""The Helm chart deploy/helm/aflex rendered as `helm template` renders it, and helpers to read the objects.

Helm's own Go engine (helm-python-sdk binds libhelm_c, a C ABI over the Helm SDK: no helm binary) renders the
chart with the values files a user passes (deploy/helm/examples) and the NATS project's chart as its dependency
(charts/nats-*.tgz). Used by tests/deploy/test_kubernetes*.py and their conftest.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import kubernetes_validate
import yaml

from shared.transport.nats_auth import ROLES
from tests.conftest import REPO_ROOT

CHART = REPO_ROOT / "deploy" / "helm" / "aflex"
EXAMPLES = REPO_ROOT / "deploy" / "helm" / "examples"
DEPLOY_DOC = REPO_ROOT / "docs" / "deploy.md"
RELEASE, NAMESPACE = "aflex", "aflex"
NATS_REPOSITORY = "https://nats-io.github.io/k8s/helm/charts/"
# the oldest Kubernetes the chart is checked against, and the newest kubernetes-validate ships schemas for
KUBE_VERSIONS = sorted({"1.30.0", kubernetes_validate.latest_version()}, key=lambda v: tuple(map(int, v.split("."))))
GPU = "nvidia.com/gpu"
AFLEX_SERVICES = ("gateway", "scheduler", "attention-worker", "ffn-worker")
WORKERS = ("attention-worker", "ffn-worker")
PROBE_ENV = {"PROBE_NATS_USER", "PROBE_NATS_PASSWORD"}  # `aflex liveness`'s own: not AFLEX_* settings
SECRET_KEYS = {f"{role}-password" for role in ROLES} | {"telemetry-user", "telemetry-url"}


# -- rendering ------------------------------------------------------------------------------------

# Helm's engine runs in a child process: the Go runtime inside libhelm_c installs its own signal handlers
# (SIGSEGV, SIGPIPE, ...) in whatever process loads it, and the rest of the suite runs in this one.
_HELM_CHILD = """
import json, sys
import helm_python as helm
OPS = {
    "render": lambda chart, values, release, namespace: helm.Chart.load(chart).render(
        values, name=release, namespace=namespace, is_install=True),
    "lint": lambda chart, values, namespace, kube_version: helm.lint(
        chart, values=values, strict=True, namespace=namespace, kube_version=kube_version),
    "set": helm.parse_set_string,
    "set_string": helm.parse_set_string_values,
}
for line in sys.stdin:
    request = json.loads(line)
    try:
        reply = {"result": OPS[request.pop("op")](**request)}
    except helm.HelmError as exc:
        reply = {"error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(reply), flush=True)
"""


class HelmError(Exception):
    """What Helm refused: a template's `fail`, values against values.schema.json, a malformed --set."""


class Helm:
    """helm-python-sdk (libhelm_c: Helm's own Go SDK, no helm binary) in one child process, started on first use.
    The chart is loaded anew for each render, as the helm command does (rendering drops disabled dependencies
    from a loaded chart)."""

    def __init__(self) -> None:
        self._child: subprocess.Popen[str] | None = None

    def call(self, op: str, **arguments: Any) -> Any:
        if self._child is None or self._child.poll() is not None:
            self._child = subprocess.Popen([sys.executable, "-c", _HELM_CHILD], stdin=subprocess.PIPE,
                                           stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT)
        assert self._child.stdin is not None and self._child.stdout is not None
        self._child.stdin.write(json.dumps({"op": op, **arguments}) + "\n")
        self._child.stdin.flush()
        line = self._child.stdout.readline()
        assert line, f"the helm child process exited ({self._child.wait()}): is helm-python-sdk installed (dev extra)?"
        reply = json.loads(line)
        if "error" in reply:
            raise HelmError(reply["error"])
        return reply["result"]

    def close(self) -> None:
        if self._child is not None:
            assert self._child.stdin is not None
            self._child.stdin.close()
            self._child.wait(10)
            self._child = None


helm = Helm()


def example(name: str) -> dict[str, Any]:
    values = yaml.safe_load((EXAMPLES / f"{name}.yaml").read_text())
    assert isinstance(values, dict)
    return values


def merged(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in override.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def render(values: dict[str, Any], release: str = RELEASE) -> list[dict[str, Any]]:
    """The objects `helm template <release> deploy/helm/aflex -f values.yaml` prints."""
    out = helm.call("render", chart=str(CHART), values=values, release=release, namespace=NAMESPACE)
    docs = [doc for path, text in sorted(out.items()) if path.endswith((".yaml", ".yml"))
            for doc in yaml.safe_load_all(text) if doc]
    assert docs and all(isinstance(d, dict) and d.get("kind") for d in docs)
    return docs


VARIANTS = {  # a user's values files as they are, and the chart's defaults
    "gpu": lambda: example("gpu"),
    "cpu": lambda: example("cpu"),
    "defaults": lambda: {},
}


# -- validation ------------------------------------------------------------------------------------

LWS_SCHEMA = REPO_ROOT / "tests" / "deploy" / "schemas" / "leaderworkerset-v1.json"


def _strict(schema: Any) -> Any:
    """A CRD schema that refuses unknown fields, as `kubectl apply --validate=strict` does (its objects declare
    their properties; the API server would prune the rest)."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out and not out.get(
            "x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


def validate(doc: dict[str, Any], kube_version: str) -> None:
    """`doc` as Kubernetes `kube_version` checks it, strictly. A LeaderWorkerSet (a CRD: kubernetes-validate has no
    schema for it) against LWS's own schema (vendored: `LWS_SCHEMA`), and each of its pod templates as a Pod."""
    if doc.get("kind") != "LeaderWorkerSet":
        kubernetes_validate.validate(doc, kube_version, strict=True)
        return
    import jsonschema

    jsonschema.validate(doc, _strict(json.loads(LWS_SCHEMA.read_text())["schema"]))
    template = doc["spec"]["leaderWorkerTemplate"]
    for which in ("leaderTemplate", "workerTemplate"):
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"{doc['metadata']['name']}-{which}",
                                                               **template[which].get("metadata", {})},
               "spec": template[which]["spec"]}
        kubernetes_validate.validate(pod, kube_version, strict=True)


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def workloads(docs: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    yield from (d for d in docs if d["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"))


def aflex_containers(docs: list[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], dict[str, Any], str]]:
    """(workload, container, service) for every AFlex container: the ones whose args name an aflex service."""
    for workload in workloads(docs):
        for container in workload["spec"]["template"]["spec"]["containers"]:
            args = container.get("args") or []
            if args and args[0] in AFLEX_SERVICES:
                yield workload, container, args[0]


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    entries = container.get("env") or []
    names = [e["name"] for e in entries]
    assert len(names) == len(set(names)), f"{container['name']}: duplicate env {names}"
    return {e["name"]: e for e in entries}


def literal(env: dict[str, dict[str, Any]], name: str) -> str:
    assert "value" in env[name], f"{name} is not a literal value"
    return str(env[name]["value"])


def nats_docs(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The objects the NATS project's chart rendered."""
    return [d for d in docs if str(d["metadata"].get("labels", {}).get("helm.sh/chart", "")).startswith("nats-")]


