"""The Helm chart deploy/helm/aflex, rendered and checked offline: no cluster, no network, no GPU.

The chart is rendered as `helm template` renders it, by Helm's own Go engine (helm-python-sdk binds libhelm_c,
a C ABI over the Helm SDK: no helm binary), with the values files a user passes (deploy/helm/examples) and
the NATS project's chart as its dependency (charts/nats-*.tgz). Every rendered object is validated against
the Kubernetes OpenAPI schemas (kubernetes-validate, strict: unknown fields fail), then checked for what the
schemas cannot see: probes aimed at ports and paths that exist, the grace period above the drain timeout, the
Secret, one GPU a worker pod, env names the services read, the NATS users of shared/transport/nats_auth.py
(and the real nats-server accepting the rendered config), and the liveness probe (`aflex liveness`) against it.
"""

from __future__ import annotations

import copy
import inspect
import itertools
import math
import os
import re
import shlex
import sys
import tarfile
from typing import Any

import kubernetes_validate
import pytest
import yaml

from services.launcher import liveness
from services.launcher.cli import SERVICES as CLI_SERVICES
from services.launcher.cli import build_parser
from shared import settings as settings_module
from shared import subjects
from tests.conftest import REPO_ROOT
from tests.deploy.chart import (
    AFLEX_SERVICES,
    CHART,
    DEPLOY_DOC,
    EXAMPLES,
    GPU,
    KUBE_VERSIONS,
    NAMESPACE,
    NATS_REPOSITORY,
    PROBE_ENV,
    WORKERS,
    HelmError,
    aflex_containers,
    by_kind,
    env_of,
    example,
    helm,
    literal,
    merged,
    render,
    validate,
    workloads,
)

# -- the chart and its NATS dependency ------------------------------------------------------------


def test_nats_comes_from_the_nats_projects_chart() -> None:
    meta = yaml.safe_load((CHART / "Chart.yaml").read_text())
    (dep,) = [d for d in meta["dependencies"] if d["name"] == "nats"]
    assert dep["repository"] == NATS_REPOSITORY and dep["condition"] == "nats.enabled"
    archive = CHART / "charts" / f"nats-{dep['version']}.tgz"  # what `helm dependency update` writes
    with tarfile.open(archive) as tar:
        member = tar.extractfile("nats/Chart.yaml")
        assert member is not None
        vendored = yaml.safe_load(member.read())
    assert (vendored["name"], vendored["version"]) == ("nats", dep["version"])
    assert vendored["home"] == "http://github.com/nats-io/k8s"
    assert sorted(p.name for p in (CHART / "charts").iterdir()) == [archive.name]
    # our templates run no nats-server of their own
    for template in (CHART / "templates").iterdir():
        assert "image: nats" not in template.read_text() and "nats-server" not in template.read_text(), template


def test_helm_lint_passes() -> None:
    for name in ("gpu", "cpu"):
        report = helm.call("lint", chart=str(CHART), values=example(name), namespace=NAMESPACE,
                           kube_version=KUBE_VERSIONS[0])  # also flags APIs that version removed
        assert not report["errors"], report
        assert all(m["severity"] <= 1 for m in report["messages"]), report["messages"]  # INFO only (icon)
    assert "helm_python" not in sys.modules  # the Go runtime stays in the child


# -- Kubernetes schemas -----------------------------------------------------------------------------


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
def test_every_object_is_valid_kubernetes(variant: tuple[str, dict, list], kube_version: str) -> None:
    name, _, docs = variant
    errors = []
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, kube_version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            errors.append(f"{doc['kind']}/{doc['metadata']['name']} {'.'.join(map(str, exc.path))}: {exc.message}")
    assert not errors, "\n".join(errors)
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert {("Deployment", "aflex-gateway"), ("Service", "aflex-gateway"), ("Deployment", "aflex-scheduler"),
            ("StatefulSet", "aflex-attn"), ("StatefulSet", "aflex-ffn"), ("Secret", "aflex-nats-auth"),
            ("StatefulSet", "aflex-nats"), ("ConfigMap", "aflex-nats-config")} <= kinds, name


def test_the_validation_is_strict() -> None:
    """A misspelt field or a wrong type fails: the schema check above is not vacuous."""
    (gateway,) = [d for d in render({}) if d["kind"] == "Deployment" and "gateway" in d["metadata"]["name"]]
    kube = KUBE_VERSIONS[-1]
    kubernetes_validate.validate(gateway, kube, strict=True)
    misspelt = copy.deepcopy(gateway)
    misspelt["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {"httpGet": {"path": "/ready"}}
    wrong_type = copy.deepcopy(gateway)
    wrong_type["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = "330s"
    for bad in (misspelt, wrong_type):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(bad, kube, strict=True)


# -- workers, GPUs ----------------------------------------------------------------------------------


def test_worker_groups_are_statefulsets_named_by_pod(variant: tuple[str, dict, list],
                                                     chart_values: dict[str, Any]) -> None:
    name, values, docs = variant
    values = merged(chart_values, values)
    services = by_kind(docs, "Service")
    ids: list[str] = []
    for workload, container, service in aflex_containers(docs):
        parsed = build_parser().parse_args(container["args"])
        assert parsed.command == service
        if service not in WORKERS:
            assert workload["kind"] == "Deployment"
            continue
        group = "attention" if service == "attention-worker" else "ffn"
        assert workload["kind"] == "StatefulSet"
        assert workload["spec"]["replicas"] == values[group]["replicas"]
        env = env_of(container)
        assert env["AFLEX_WORKER_ID"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
        assert env["AFLEX_SEAM_HOST"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        headless = services[workload["spec"]["serviceName"]]
        assert headless["spec"]["clusterIP"] == "None"
        assert headless["spec"]["selector"] == workload["spec"]["selector"]["matchLabels"]
        sts = workload["metadata"]["name"]
        assert len(sts) <= 52  # the pods' controller-revision-hash label is the name and 11 more characters
        ids += [subjects.check_token(f"{sts}-{i}") for i in range(workload["spec"]["replicas"])]
    assert len(ids) == len(set(ids)) == values["attention"]["replicas"] + values["ffn"]["replicas"], name
    gateways = [w for w, _, s in aflex_containers(docs) if s == "gateway"]
    schedulers = [w for w, _, s in aflex_containers(docs) if s == "scheduler"]
    assert len(gateways) == 1 and gateways[0]["spec"]["replicas"] == values["gateway"]["replicas"]
    assert len(schedulers) == 1 and schedulers[0]["spec"]["replicas"] == 1
    assert schedulers[0]["spec"]["strategy"]["type"] == "Recreate"  # never two schedulers at once


def gpu_asks(container: dict[str, Any]) -> dict[str, Any]:
    resources = container.get("resources") or {}
    return {f"{kind}.{res}": n for kind in ("requests", "limits") for res, n in (resources.get(kind) or {}).items()
            if "gpu" in res}


def test_each_worker_pod_asks_for_exactly_one_gpu_when_gpu_is_on() -> None:
    values = example("gpu")
    # whatever a user writes into resources, a worker pod gets one GPU
    values["ffn"]["resources"] = merged(values["ffn"].get("resources", {}), {"limits": {GPU: 4}, "requests": {GPU: 2}})
    docs = render(values)
    seen = set()
    for workload, container, service in aflex_containers(docs):
        pod = workload["spec"]["template"]["spec"]
        assert len(pod["containers"]) == 1
        env = env_of(container)
        if service in WORKERS:
            seen.add(service)
            assert gpu_asks(container) == {f"requests.{GPU}": 1, f"limits.{GPU}": 1}, service
            assert container["image"].endswith(":cuda")
            assert literal(env, "AFLEX_DEVICE") == "cuda"
            assert literal(env, "AFLEX_GPU_BACKEND") == values["gpu"]["control"]
            assert {"key": GPU, "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
            assert container["resources"]["requests"]["memory"] == "32Gi"  # the user's resources are kept
        else:
            assert gpu_asks(container) == {}, service
    assert seen == set(WORKERS)


def test_a_worker_group_pod_asks_for_a_gpu_a_rank_and_says_its_size() -> None:
    docs = render(merged(example("gpu"), {"attention": {"tp": 2}, "ffn": {"tp": 2, "ep": 2}}))
    groups = {}
    for _, container, service in aflex_containers(docs):
        if service in WORKERS:
            env, names = env_of(container), {e["name"] for e in container["env"]}
            sizes = {name: literal(env, name) for name in ("AFLEX_ATTENTION_TP", "AFLEX_FFN_TP", "AFLEX_FFN_EP")
                     if name in names}
            groups[service] = (gpu_asks(container)[f"limits.{GPU}"], gpu_asks(container)[f"requests.{GPU}"], sizes)
    assert groups == {"attention-worker": (2, 2, {"AFLEX_ATTENTION_TP": "2"}),
                      "ffn-worker": (4, 4, {"AFLEX_FFN_TP": "2", "AFLEX_FFN_EP": "2"})}


def test_no_pod_asks_for_a_gpu_when_gpu_is_off() -> None:
    docs = render(example("cpu"))
    for workload in workloads(docs):
        pod = workload["spec"]["template"]["spec"]
        for container in pod["containers"] + pod.get("initContainers", []):
            assert gpu_asks(container) == {}, workload["metadata"]["name"]
        assert "runtimeClassName" not in pod
        assert not any("gpu" in str(t) for t in pod.get("tolerations", []))
    for _, container, service in aflex_containers(docs):
        env = env_of(container)
        assert container["image"].endswith(":cpu")
        if service in WORKERS:
            assert literal(env, "AFLEX_DEVICE") == "cpu" and literal(env, "AFLEX_GPU_BACKEND") == "emulated"


def test_nvml_clock_control_runs_the_workers_as_root_with_sys_admin() -> None:
    docs = render(merged(example("gpu"), {"gpu": {"control": "nvml"}}))
    for workload, container, service in aflex_containers(docs):
        pod_security = workload["spec"]["template"]["spec"]["securityContext"]
        caps = (container.get("securityContext") or {}).get("capabilities", {})
        if service in WORKERS:
            assert pod_security["runAsUser"] == 0 and caps.get("add") == ["SYS_ADMIN"]
        else:
            assert pod_security["runAsNonRoot"] is True and caps.get("drop") == ["ALL"]


# -- probes, grace period -------------------------------------------------------------------------


def test_probes_point_at_ports_and_paths_that_exist(variant: tuple[str, dict, list]) -> None:
    from services.gateway.app import probes as gateway_probes

    _, _, docs = variant
    gateway_paths = {route.path for route in gateway_probes.routes}  # type: ignore[attr-defined]
    checked = 0
    for workload in workloads(docs):
        pod = workload["spec"]["template"]["spec"]
        for container in pod["containers"]:
            ports = {p.get("name"): p["containerPort"] for p in container.get("ports", [])}
            service = (container.get("args") or [None])[0]
            assert service not in AFLEX_SERVICES or "livenessProbe" in container, container["name"]
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                probe = container.get(kind)
                if probe is None:
                    continue
                checked += 1
                if "httpGet" in probe:
                    port = probe["httpGet"]["port"]
                    assert port in ports or port in ports.values(), f"{container['name']} {kind}: port {port}"
                    if service == "gateway":
                        number = ports[port] if isinstance(port, str) else port
                        assert number == int(literal(env_of(container), "AFLEX_PORT"))
                        assert probe["httpGet"]["path"] in gateway_paths
                        assert probe["httpGet"]["path"] == ("/ready" if kind == "readinessProbe" else "/health")
                elif "exec" in probe:
                    command = probe["exec"]["command"]
                    if service not in AFLEX_SERVICES:
                        continue  # the NATS chart's own
                    # the image's own program (its ENTRYPOINT, which the container runs: no command of its own),
                    # parsed as the image parses it: `aflex liveness <this container's service>`, nothing mounted
                    assert command[0] == "aflex" and "command" not in container, container["name"]
                    parsed = build_parser().parse_args(command[1:])
                    assert (parsed.func, parsed.service) == (liveness.liveness, service), command
                    assert probe["timeoutSeconds"] > parsed.wait
                else:
                    pytest.fail(f"{container['name']} {kind}: {probe}")
    assert checked


def test_startup_probes_allow_for_loading_the_model() -> None:
    budget = 2400
    docs = render(merged(example("gpu"), {"probes": {"startupTimeoutS": budget}}))
    for _, container, service in aflex_containers(docs):
        probe = container["startupProbe"]
        assert probe["periodSeconds"] * probe["failureThreshold"] >= budget, service


@pytest.mark.parametrize(("drain", "margin"), [(None, None), (600, 45), (42.5, 10)])
def test_grace_period_follows_the_drain_timeout(chart_values: dict[str, Any], drain: float | None,
                                                margin: int | None) -> None:
    values = example("gpu")
    if drain is not None:
        values |= {"drainTimeoutS": drain, "graceMarginS": margin}
    docs = render(values)
    drain = drain if drain is not None else chart_values["drainTimeoutS"]
    margin = margin if margin is not None else chart_values["graceMarginS"]
    # the chart's default is the services' own
    assert settings_module.ServiceSettings.model_fields["drain_timeout_s"].default == chart_values["drainTimeoutS"]
    seen = set()
    for workload, container, service in aflex_containers(docs):
        seen.add(service)
        grace = workload["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert float(literal(env_of(container), "AFLEX_DRAIN_TIMEOUT_S")) == drain, service
        assert grace == math.ceil(drain) + margin and grace > drain, service
        pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command")
        if pre_stop:  # the gateway's sleep comes out of the same grace period
            assert pre_stop[0] == "sleep" and float(pre_stop[1]) + drain < grace
    assert seen == set(AFLEX_SERVICES)


# -- env names ------------------------------------------------------------------------------------


def test_env_names_are_settings_the_services_read(variant: tuple[str, dict, list],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Each AFLEX_* variable is a field of the service's settings class (pydantic-settings, prefix AFLEX_, which
    ignores unknown names silently), and the literal values parse: the service would start with them."""
    _, _, docs = variant
    probe_source = inspect.getsource(liveness)
    assert all(f'"{name}"' in probe_source for name in PROBE_ENV)
    for name in list(os.environ):
        if name.startswith("AFLEX_"):
            monkeypatch.delenv(name)
    for _, container, service in aflex_containers(docs):
        settings_class = getattr(settings_module, CLI_SERVICES[service][0])
        fields = {f"AFLEX_{field.upper()}" for field in settings_class.model_fields}
        env = env_of(container)
        assert set(env) - fields <= PROBE_ENV, (service, sorted(set(env) - fields - PROBE_ENV))
        with monkeypatch.context() as patch:
            for name, entry in env.items():
                if name.startswith("AFLEX_"):
                    patch.setenv(name, str(entry["value"]) if "value" in entry else "4")  # valueFrom: a stand-in
            settings_class()  # raises where a value does not parse


@pytest.mark.parametrize(("values", "error"), [
    ({"env": {"AFLEX_MODEL": "x"}}, "AFLEX_MODEL is the chart's to set"),
    ({"attention": {"env": {"AFLEX_WORKER_ID": "a"}}}, "AFLEX_WORKER_ID is the chart's to set"),
    ({"env": {"MODEL": "x"}}, "MODEL"),
    ({"attention": {"replica": 2}}, "replica"),
    ({"gpu": {"control": "nvml-rw"}}, "control"),
    ({"auth": {"passwords": {"telemetry": "p@ss word"}}}, "telemetry"),
], ids=["reserved", "reserved-worker", "not-aflex", "typo", "backend", "password"])
def test_values_that_would_not_work_are_refused(values: dict[str, Any], error: str) -> None:
    with pytest.raises(HelmError, match=error):
        render(values)


def test_a_dotted_release_name_is_refused() -> None:
    with pytest.raises(HelmError, match="without dots"):
        render({}, release="aflex.prod")
    render({}, release="prod")  # prod-aflex-attn-0 ...


# -- the docs -----------------------------------------------------------------------------------------


def helm_commands(doc: str) -> list[list[str]]:
    """The `helm install` and `helm upgrade` commands of a document's code blocks, as argv lists."""
    blocks = re.findall(r"```bash\n(.*?)```", doc, flags=re.S)
    lines = [line.split(" #")[0] for block in blocks for line in block.replace("\\\n", " ").splitlines()]
    return [shlex.split(line)[1:] for line in lines if re.match(r"helm (install|upgrade) ", line)]


def command_values(argv: list[str]) -> dict[str, Any]:
    """The values a helm command line gives, in helm's order: -f files merged, then each --set (helm's parser)."""
    files: list[dict[str, Any]] = []
    sets: list[dict[str, Any]] = []
    for flag, arg in itertools.pairwise(argv):
        if flag in ("-f", "--values"):
            files.append(yaml.safe_load((REPO_ROOT / arg).read_text()))
        elif flag == "--set":
            sets.append(helm.call("set", expression=arg))
        elif flag == "--set-string":
            sets.append(helm.call("set_string", expression=arg))
    values: dict[str, Any] = {}
    for layer in files + sets:
        values = merged(values, layer)
    return values


def test_the_docs_helm_commands_render_valid_manifests(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each `helm install`/`helm upgrade` in docs/deploy.md, with its -f files and --set values as written, renders
    objects that are valid Kubernetes and start the services; the docs name every example file."""
    doc = DEPLOY_DOC.read_text()
    commands = helm_commands(doc)
    assert len(commands) >= 4 and all(argv[2] == "deploy/helm/aflex" for argv in commands), commands
    files = {arg for argv in commands for flag, arg in itertools.pairwise(argv) if flag == "-f"}
    assert files == {f"deploy/helm/examples/{p.name}" for p in EXAMPLES.glob("*.yaml")}
    for argv in commands:
        docs = render(command_values(argv), release=argv[1])
        for doc_object in docs:
            validate(doc_object, KUBE_VERSIONS[-1])
        test_env_names_are_settings_the_services_read(("docs", {}, docs), monkeypatch)
    assert "helm dependency update deploy/helm/aflex" in doc and f"helm repo add nats {NATS_REPOSITORY}" in doc
