"""docs/protocol.md is generated from the code and must match it; its schemas must match what goes on the wire."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import nats
import pytest
import torch

from shared import error_types, messages, subjects
from shared.error_types import ErrorType
from shared.messages import Message, encode
from shared.transport import header as seam_header
from shared.transport.nats_server import EmbeddedNatsServer
from tests.conftest import REPO_ROOT
from tools import protocol_doc

DOC = REPO_ROOT / "docs" / "protocol.md"


def public_subject_names() -> list[str]:
    """Every public constant and function of shared/subjects.py (the annotations import excluded)."""
    return [name for name, obj in vars(subjects).items()
            if not name.startswith("_") and name != "annotations"
            and (isinstance(obj, str) or (inspect.isfunction(obj) and obj.__module__ == subjects.__name__))]


def test_doc_is_rendered_from_the_code() -> None:
    assert DOC.read_text(encoding="utf-8") == protocol_doc.render(), \
        "docs/protocol.md is stale: run `python -m tools.protocol_doc`"


def test_check_flag(tmp_path: Path) -> None:
    path = tmp_path / "protocol.md"
    assert protocol_doc.main(["--check", "--path", str(path)]) == 1  # missing
    path.write_text("stale\n", encoding="utf-8")
    assert protocol_doc.main(["--check", "--path", str(path)]) == 1
    assert protocol_doc.main(["--path", str(path)]) == 0
    assert protocol_doc.main(["--check", "--path", str(path)]) == 0
    assert protocol_doc.main(["--check"]) == 0  # the committed file


def test_every_subject_is_documented() -> None:
    doc = protocol_doc.render()
    names = public_subject_names()
    assert {"PREFIX", "REQ_SUBMIT", "req_out", "freq", "telemetry", "check_token"} <= set(names)
    for name in names:
        assert re.search(rf"`{name}[`(]", doc), f"shared/subjects.py:{name} is missing from docs/protocol.md"
        value = getattr(subjects, name)
        if isinstance(value, str):
            assert f"`{value}`" in doc, f"the value of {name} ({value}) is missing from docs/protocol.md"
    # every subject builder has a row in the subject table (PREFIX and check_token are conventions)
    table_names = {name for row in protocol_doc.SUBJECTS for name in row.names}  # the rows render() writes
    assert set(names) - table_names == {"PREFIX", "check_token"}
    assert table_names <= set(names)


def test_every_message_has_its_schema_in_the_doc() -> None:
    doc = protocol_doc.render()
    found = {cls.__name__ for cls in protocol_doc.message_types()}
    defined = {name for name, obj in vars(messages).items()
               if isinstance(obj, type) and issubclass(obj, Message) and obj is not Message}
    assert found == defined
    for cls in protocol_doc.message_types():
        schema = json.dumps(cls.model_json_schema(), indent=2, ensure_ascii=False)
        assert f"### {cls.__name__}\n" in doc
        assert f"```json\n{schema}\n```" in doc, f"the JSON Schema of {cls.__name__} is missing"
        assert protocol_doc.description(cls)
        # every message is either sent on a subject or part of one that is
        assert protocol_doc.subject_of(cls) or protocol_doc.nested_in(cls), cls.__name__


def test_schemas_are_valid_and_strict_enough() -> None:
    for cls in protocol_doc.message_types():
        schema = cls.model_json_schema()
        jsonschema.Draft202012Validator.check_schema(schema)
        validator = jsonschema.Draft202012Validator(schema)
        instance = json.loads(encode(protocol_doc.example(cls)))
        validator.validate(instance)
        for field in schema.get("required", []):  # a missing required field is caught
            broken = {k: v for k, v in instance.items() if k != field}
            assert not validator.is_valid(broken), f"{cls.__name__} without {field} validated"


def test_the_seam_header_layout_is_the_documented_one() -> None:
    """The documented fields, in order, add up to the header's real size, and each packs as documented."""
    doc = protocol_doc.render()
    assert f"`{seam_header.MAGIC.decode()}`" in doc and f"fixed {seam_header.HEADER_BYTES}-byte header" in doc
    sizes = {"4 bytes": 4, "u8": 1, "3 bytes": 3, "i32": 4, "u32": 4, "u16": 2, "u64": 8, "f64": 8,
             f"{seam_header.MAX_DIMS} × u64": 8 * seam_header.MAX_DIMS,
             f"{seam_header.MB_ID_MAX_BYTES} bytes": seam_header.MB_ID_MAX_BYTES,
             f"{seam_header.END_PAD_BYTES} bytes": seam_header.END_PAD_BYTES}
    assert sum(sizes[kind] for _, kind, _ in protocol_doc.FRAME_FIELDS) == seam_header.HEADER_BYTES
    header = dataclasses.replace(seam_header.header_for("to_attention", "m-0", 3, "prefill", torch.zeros(7, 64),
                                                        energy_j=0.25), reply_tag=77)
    packed = header.pack()
    offset = {name: sum(sizes[k] for _, k, _ in protocol_doc.FRAME_FIELDS[:i])
              for i, (name, _, _) in enumerate(protocol_doc.FRAME_FIELDS)}
    assert packed[offset["kind"]] == 1 and packed[offset["phase"]] == 1 and packed[offset["ndim"]] == 2
    assert int.from_bytes(packed[offset["layer"]:offset["layer"] + 4], "big") == 3
    assert int.from_bytes(packed[offset["reply_tag"]:offset["reply_tag"] + 4], "big") == 77
    assert int.from_bytes(packed[offset["nbytes"]:offset["nbytes"] + 8], "big") == 7 * 64 * 4
    assert packed[offset["mb_id"]:offset["mb_id"] + 3] == b"m-0"


def _subject_for(cls: type[Message]) -> str:
    """A concrete subject the message travels on (placeholders filled), or a scratch one for parts."""
    on = protocol_doc.subject_of(cls)
    if not on:
        return f"_aflex_doc_test.{cls.__name__}"
    role = "scheduler" if cls is messages.SchedulerTelemetry else "attention"
    return on[0].replace("<rid>", "req-1").replace("<wid>", "w-1").replace("<role>", role)


def test_live_messages_validate_against_their_schemas() -> None:
    """Encode each message, send it through a real nats-server, validate what arrives against its schema."""

    async def main(url: str) -> list[tuple[str, str, dict[str, Any]]]:
        nc = await nats.connect(url)
        received: list[tuple[str, str, dict[str, Any]]] = []
        try:
            for cls in protocol_doc.message_types():
                subject = _subject_for(cls)
                sub = await nc.subscribe(subject)
                await nc.flush()
                await nc.publish(subject, encode(protocol_doc.example(cls)))
                msg = await sub.next_msg(timeout=5)
                received.append((cls.__name__, msg.subject, json.loads(msg.data)))
                await sub.unsubscribe()
        finally:
            await nc.drain()
        return received

    with EmbeddedNatsServer() as server:
        received = asyncio.run(main(server.url))
    by_name = {cls.__name__: cls for cls in protocol_doc.message_types()}
    assert [name for name, _, _ in received] == list(by_name)
    for name, subject, payload in received:
        assert subject == _subject_for(by_name[name])
        jsonschema.Draft202012Validator(by_name[name].model_json_schema()).validate(payload)
        assert by_name[name].model_validate(payload) == protocol_doc.example(by_name[name])


@pytest.mark.parametrize("name", ["SubmitRequest", "MicrobatchDone", "FrequencyCommand"])
def test_schema_rejects_wrong_types(name: str) -> None:
    cls = getattr(messages, name)
    instance = json.loads(encode(protocol_doc.example(cls)))
    first_string = next(k for k, v in instance.items() if isinstance(v, str))
    instance[first_string] = 12
    assert not jsonschema.Draft202012Validator(cls.model_json_schema()).is_valid(instance)


def test_documented_error_codes_exist_in_the_code() -> None:
    """Every documented code is set by a service, next to the documented type (an `ErrorType` member)."""
    root = REPO_ROOT
    source = "\n".join(p.read_text(encoding="utf-8") for p in sorted((root / "services").rglob("*.py")))
    for code, error_type, _, _ in protocol_doc.ERROR_CODES:
        name = ErrorType(error_type).name  # a documented type is one of the vocabulary's
        if code == "(none)":
            assert f"ErrorType.{name}" in source, f"error type {error_type} is documented but no service sets it"
            continue
        # a code is set as a literal, or through its name in shared/error_types.py
        names = [f'"{code}"', *(re.escape(name) for name, value in vars(error_types).items() if value == code)]
        spots = [m.start() for m in re.finditer("|".join(names), source)]
        assert spots, f"error code {code} is documented but no service sets it"
        near = [source[max(0, i - 300):i + 300] for i in spots]
        assert any(f"ErrorType.{name}" in w or f"type={name}" in w for w in near), \
            f"error code {code} is never set with its documented type {error_type}"
