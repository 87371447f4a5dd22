"""The chart's Secret, its NATS (the NATS project's chart, with the users of shared/transport/nats_auth.py), the
liveness probe against a real nats-server running the rendered config, and the docs' helm commands rendering.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from shared import subjects
from shared.transport.nats_auth import ROLES, SERVICE_ROLES
from tests.conftest import REPO_ROOT
from tests.deploy.chart import (
    RELEASE,
    SECRET_KEYS,
    HelmError,
    aflex_containers,
    by_kind,
    env_of,
    example,
    literal,
    merged,
    nats_docs,
    render,
    workloads,
)

# -- the Secret and NATS ----------------------------------------------------------------------------


def nats_conf(docs: list[dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    """The NATS chart's rendered nats.conf (JSON with `<< >>` values unquoted), and it parsed."""
    (config_map,) = [d for d in nats_docs(docs) if d["kind"] == "ConfigMap"]
    text = config_map["data"]["nats.conf"]
    as_json = re.sub(r'(:\s*)(\$[A-Za-z_][A-Za-z0-9_]*|\d+[KMG]B)(\s*,?\s*)$', r'\1"\2"\3', text, flags=re.M)
    return text, json.loads(as_json)


def test_secret_holds_the_role_passwords_and_the_telemetry_credentials(variant: tuple[str, dict, list]) -> None:
    _, _, docs = variant
    secret = by_kind(docs, "Secret")[f"{RELEASE}-nats-auth"]
    data = secret["stringData"]
    assert set(data) == SECRET_KEYS
    passwords = [data[f"{role}-password"] for role in ROLES]
    assert all(len(p) >= 16 for p in passwords) and len(set(passwords)) == len(passwords)
    assert data["telemetry-user"] == "telemetry"
    url = urlsplit(data["telemetry-url"])
    assert (url.username, url.password) == ("telemetry", data["telemetry-password"])
    assert url.hostname in by_kind(nats_docs(docs), "Service") and url.port == 4222
    # every secret a pod reads is this one (or the user's API key), by a key it has
    for workload in workloads(docs):
        for container in workload["spec"]["template"]["spec"]["containers"]:
            for entry in container.get("env") or []:
                ref = entry.get("valueFrom", {}).get("secretKeyRef")
                if ref and entry["name"] != "AFLEX_API_KEY":
                    assert ref["name"] == secret["metadata"]["name"] and ref["key"] in data, entry
    # the NATS server gets every role's password under the name its config reads
    (nats,) = [w for w in workloads(nats_docs(docs))]
    (server,) = [c for c in nats["spec"]["template"]["spec"]["containers"] if c["name"] == "nats"]
    env = env_of(server)
    for role in ROLES:
        assert env[f"AFLEX_NATS_PASSWORD_{role.upper()}"]["valueFrom"]["secretKeyRef"] == {
            "name": secret["metadata"]["name"], "key": f"{role}-password"}


def test_passwords_a_user_sets_are_the_secrets() -> None:
    passwords = {role: f"pw-{role}-0123456789" for role in ROLES}
    passwords["telemetry"] = "Tel.em~etry_pass-word"
    docs = render(merged(example("cpu"), {"auth": {"passwords": passwords}}))
    data = by_kind(docs, "Secret")[f"{RELEASE}-nats-auth"]["stringData"]
    assert {role: data[f"{role}-password"] for role in ROLES} == passwords
    assert urlsplit(data["telemetry-url"]).password == passwords["telemetry"]  # nats-py reads it as it is
    assert not by_kind(render(merged(example("cpu"), {"auth": {"create": False}})), "Secret")


def test_the_api_key_comes_from_the_users_secret() -> None:
    docs = render(merged(example("gpu"), {"gateway": {"apiKeySecret": {"name": "aflex-api-key", "key": "key"}}}))
    keys = {s: env_of(c).get("AFLEX_API_KEY") for _, c, s in aflex_containers(docs)}
    assert keys.pop("gateway") == {"name": "AFLEX_API_KEY", "valueFrom": {"secretKeyRef": {
        "name": "aflex-api-key", "key": "key"}}}
    assert set(keys.values()) == {None}  # the gateway's alone
    assert "AFLEX_API_KEY" not in {n for _, c, _ in aflex_containers(render(example("gpu"))) for n in env_of(c)}


def test_nats_has_the_roles_users_and_the_real_server_accepts_its_config(variant: tuple[str, dict, list],
                                                                         tmp_path: Path) -> None:
    from shared.transport.nats_server import nats_server_binary

    _, _, docs = variant
    text, conf = nats_conf(docs)
    users = {u["user"]: u for u in conf["authorization"]["users"]}
    assert set(users) == set(ROLES)
    for role, perms in ROLES.items():
        user = users[role]
        assert user["password"] == f"$AFLEX_NATS_PASSWORD_{role.upper()}"
        want_publish = {"allow": list(perms.publish)} if perms.publish else {"deny": [">"]}
        assert user["permissions"]["publish"] == want_publish, role
        assert user["permissions"]["subscribe"] == {"allow": list(perms.subscribe)}, role
        assert user["permissions"].get("allow_responses", False) == perms.responds, role
    # the server limits of compose/nats.conf (and of `aflex up`'s embedded server)
    compose_conf = (REPO_ROOT / "compose" / "nats.conf").read_text()
    for key in ("max_payload", "max_pending", "write_deadline"):
        (want,) = re.findall(rf'^{key}:\s*"?([^"\s#]+)', compose_conf, flags=re.M)
        assert str(conf[key]) == want, key
    path = tmp_path / "nats.conf"
    path.write_text(text)
    env = {**os.environ, "SERVER_NAME": "nats-0", **{f"AFLEX_NATS_PASSWORD_{r.upper()}": f"pw-{r}" for r in ROLES}}
    checked = subprocess.run([str(nats_server_binary()), "-c", str(path), "-t"], env=env, capture_output=True,
                             text=True, timeout=30)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_each_service_lists_the_nats_nodes_it_may_use(variant: tuple[str, dict, list]) -> None:
    name, _, docs = variant
    (nats,) = [w for w in workloads(nats_docs(docs)) if w["kind"] == "StatefulSet"]
    (server,) = [c for c in nats["spec"]["template"]["spec"]["containers"] if c["name"] == "nats"]
    client_port = {p["name"]: p["containerPort"] for p in server["ports"]}["nats"]
    _, conf = nats_conf(docs)
    firsts = set()
    for _, container, service in aflex_containers(docs):
        env = env_of(container)
        assert literal(env, "AFLEX_NATS_USER") == SERVICE_ROLES[service]
        assert env["AFLEX_NATS_PASSWORD"]["valueFrom"]["secretKeyRef"]["key"] == f"{SERVICE_ROLES[service]}-password"
        urls = [urlsplit(u) for u in literal(env, "AFLEX_NATS_URL").split(",")]
        assert all(u.scheme == "nats" and u.port == client_port for u in urls)
        if "cluster" in conf:
            pods = {f"{nats['metadata']['name']}-{i}.{nats['spec']['serviceName']}"
                    for i in range(nats["spec"]["replicas"])}
            assert sorted(str(u.hostname) for u in urls) == sorted(pods), service
            firsts.add(urls[0].hostname)
        else:
            assert [u.hostname for u in urls] == list(by_kind(nats_docs(docs), "Service").keys() - {
                nats["spec"]["serviceName"]}), service
    if "cluster" in conf:
        assert len(firsts) == min(3, nats["spec"]["replicas"]), name  # spread, as compose.cluster.yaml does


def test_a_nats_cluster_of_your_own() -> None:
    url = "nats://nats-a.messaging:4222,nats://nats-b.messaging:4222"
    docs = render(merged(example("gpu"), {"nats": {"enabled": False}, "natsUrl": url}))
    assert not nats_docs(docs)
    assert {literal(env_of(c), "AFLEX_NATS_URL") for _, c, _ in aflex_containers(docs)} == {url}
    with pytest.raises(HelmError, match="natsUrl"):
        render({"nats": {"enabled": False}})


# -- the liveness probe, against the rendered NATS config -------------------------------------------


async def _run_probes(commands: dict[str, list[str]], url: str, passwords: dict[str, str]) -> dict[str, int | None]:
    import nats

    base = {**{k: v for k, v in os.environ.items() if not k.startswith("AFLEX_")},
            "PROBE_NATS_USER": "telemetry", "PROBE_NATS_PASSWORD": passwords["telemetry"]}
    cases = {
        "alive": ("attention-worker", {"AFLEX_NATS_URL": url, "AFLEX_WORKER_ID": "aflex-attn-0"}),
        "silent": ("ffn-worker", {"AFLEX_NATS_URL": url, "AFLEX_WORKER_ID": "aflex-ffn-0"}),
        "scheduler-silent": ("scheduler", {"AFLEX_NATS_URL": url, "AFLEX_TELEMETRY_HZ": "10"}),
        "no-telemetry": ("ffn-worker", {"AFLEX_NATS_URL": url, "AFLEX_WORKER_ID": "x", "AFLEX_TELEMETRY_HZ": "0"}),
        "nats-down": ("ffn-worker", {"AFLEX_NATS_URL": "nats://127.0.0.1:9", "AFLEX_WORKER_ID": "aflex-ffn-0"}),
    }
    worker = await nats.connect(url, user="attention", password=passwords["attention"])
    try:
        procs = {case: await asyncio.create_subprocess_exec(
            *commands[service], env={**base, **extra}, cwd=REPO_ROOT,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
            for case, (service, extra) in cases.items()}
        waits = {case: asyncio.ensure_future(proc.communicate()) for case, proc in procs.items()}
        while not waits["alive"].done():  # the attention worker's telemetry, as its own user publishes it
            await worker.publish(subjects.telemetry("attention", "aflex-attn-0"), b"{}")
            await asyncio.sleep(0.05)
        outputs = {case: (await wait)[0].decode() for case, wait in waits.items()}
    finally:
        await worker.close()
    print(outputs)  # shown when the test fails
    return {case: proc.returncode for case, proc in procs.items()}


def test_liveness_probe_reads_a_workers_telemetry(tmp_path: Path) -> None:
    """The rendered probe command (`aflex liveness <service>`, this venv's `aflex` as the image's) on a real
    nats-server running the rendered config: 0 for a worker whose telemetry flows, 1 for a silent one, 0 when
    NATS is away or telemetry is off."""
    from shared.transport.nats_server import free_port, nats_server_binary, wait_for_port

    passwords = {role: f"pw-{role}-0123456789" for role in ROLES}
    docs = render(merged(example("cpu"), {"auth": {"passwords": passwords}}))
    text, _ = nats_conf(docs)
    (conf := tmp_path / "nats.conf").write_text(text)
    aflex = Path(sys.executable).parent / "aflex"  # the console script the image's ENTRYPOINT is
    commands = {}
    for _, container, service in aflex_containers(docs):
        if "exec" in container.get("livenessProbe", {}):
            command = container["livenessProbe"]["exec"]["command"]
            assert command[0] == "aflex"
            commands[service] = [str(aflex), *command[1:command.index("--wait") + 1], "1"]
    assert set(commands) == {"scheduler", "attention-worker", "ffn-worker"}
    port, http_port = free_port(), free_port()
    env = {**os.environ, "SERVER_NAME": "nats-0",
           **{f"AFLEX_NATS_PASSWORD_{role.upper()}": pw for role, pw in passwords.items()}}
    server = subprocess.Popen([str(nats_server_binary()), "-c", str(conf), "-a", "127.0.0.1", "-p", str(port),
                               "-m", str(http_port), "-P", str(tmp_path / "nats.pid")], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_port("127.0.0.1", port, 10)
        codes = asyncio.run(_run_probes(commands, f"nats://127.0.0.1:{port}", passwords))
    finally:
        server.terminate()
        server.wait(10)
    assert codes == {"alive": 0, "silent": 1, "scheduler-silent": 1, "no-telemetry": 0, "nats-down": 0}
