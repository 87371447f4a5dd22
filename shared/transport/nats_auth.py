"""Per-role NATS users: each service may publish and subscribe only where its role needs to.

Only the scheduler may publish frequency commands (`freq.>`) and role assignments (`control.role.*`): no
other client can set a GPU clock or park a worker.
An outside subscriber (a dashboard, `aflex top`, `aflex bench`) gets the read-only `telemetry`
role. Requests are answered through `allow_responses` (a responder may publish to the reply subject
of a request it received, and nowhere else in `_INBOX`), so no role may publish into `_INBOX.>`.
`aflex up` writes these users into its embedded server; compose/nats.conf holds the same block.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from urllib.parse import quote, urlsplit, urlunsplit

from shared.subjects import PREFIX

INBOX = "_INBOX.>"  # where request replies land (nats-py's response inboxes)


@dataclass(frozen=True)
class Permissions:
    publish: tuple[str, ...]  # empty: may publish nothing
    subscribe: tuple[str, ...]
    responds: bool = False  # answers requests (allow_responses)


P = PREFIX
ROLES: dict[str, Permissions] = {
    "scheduler": Permissions(
        publish=(f"{P}.freq.>", f"{P}.control.role.*", f"{P}.attn.*.mb", f"{P}.attn.*.kv",
                 f"{P}.req.*.out",
                 f"{P}.telemetry.scheduler.>", f"{P}.telemetry.plan", f"{P}.sched.heartbeat"),
        subscribe=(f"{P}.control.register", f"{P}.control.heartbeat.*", f"{P}.control.drain.*",
                   f"{P}.sched.done", f"{P}.sched.status", f"{P}.req.submit", f"{P}.req.*.cancel",
                   f"{P}.gateway.heartbeat", INBOX),
        responds=True),
    "gateway": Permissions(
        publish=(f"{P}.req.submit", f"{P}.req.*.cancel", f"{P}.sched.status", f"{P}.gateway.heartbeat"),
        subscribe=(f"{P}.req.*.out", f"{P}.telemetry.>", f"{P}.sched.heartbeat", INBOX)),
    "attention": Permissions(
        publish=(f"{P}.control.register", f"{P}.control.heartbeat.*", f"{P}.control.drain.*", f"{P}.sched.done",
                 f"{P}.telemetry.attention.>", f"{P}.seam.*"),
        subscribe=(f"{P}.attn.*.mb", f"{P}.attn.*.kv", f"{P}.freq.*", f"{P}.control.role.*",
                   f"{P}.control.heartbeat.*", f"{P}.seam.*", INBOX),
        responds=True),
    "ffn": Permissions(
        publish=(f"{P}.control.register", f"{P}.control.heartbeat.*", f"{P}.control.drain.*",
                 f"{P}.telemetry.ffn.>", f"{P}.seam.*"),
        subscribe=(f"{P}.freq.*", f"{P}.control.role.*", f"{P}.seam.*", INBOX)),
    "telemetry": Permissions(publish=(), subscribe=(f"{P}.telemetry.>",)),
}
SERVICE_ROLES = {"scheduler": "scheduler", "gateway": "gateway", "attention-worker": "attention",
                 "ffn-worker": "ffn"}  # `aflex up`'s child roles -> their NATS users


def new_credentials() -> dict[str, str]:
    """A random password for every role (URL-safe characters only)."""
    return {role: secrets.token_urlsafe(18) for role in ROLES}


def _list(subjects: tuple[str, ...]) -> str:
    return "[" + ", ".join(f'"{s}"' for s in subjects) + "]"


def authorization_block(passwords: dict[str, str], *, quoted: bool = True) -> str:
    """The nats.conf `authorization` block for these passwords (`quoted=False`: they are `$VARIABLE`s)."""
    lines = ["authorization {", "  users = ["]
    for role, perms in ROLES.items():
        password = f'"{passwords[role]}"' if quoted else passwords[role]
        publish = f"allow: {_list(perms.publish)}" if perms.publish else 'deny: [">"]'
        responses = ", allow_responses: true" if perms.responds else ""
        lines.append(f'    {{user: "{role}", password: {password}, permissions: {{')
        lines.append(f"      publish: {{{publish}}}")
        lines.append(f"      subscribe: {{allow: {_list(perms.subscribe)}}}{responses}}}}}")
    lines += ["  ]", "}"]
    return "\n".join(lines) + "\n"


def url_for(url: str, user: str, password: str) -> str:
    """`url` with these credentials in it (nats-py takes them from there)."""
    parts = urlsplit(url)
    netloc = f"{quote(user, safe='')}:{quote(password, safe='')}@{parts.hostname}:{parts.port}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
