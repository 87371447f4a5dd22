"""Schemathesis against the live mesh (`aflex up`, a tiny model): no server errors, answers as documented.

Every operation in /openapi.json gets generated requests, valid ones and invalid ones (schemathesis's
positive and negative modes, a bounded number of examples each). Every answer must be documented
(status code, content type, body schema), and no request may get a 5xx; an invalid request must be
refused with a 4xx. To keep the run bounded, valid requests come from a narrowed schema: the model is
the one served and `max_tokens` is given and small. Accepting every schema-valid request is not asked: a prompt
longer than the context is schema-valid and rightly refused.
"""

from __future__ import annotations

from typing import Any

import httpx2 as httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    negative_data_rejection,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from tools.launch import Mesh

EXAMPLES = 25  # per operation and mode
MAX_TOKENS = 4
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          negative_data_rejection]


@pytest.fixture(scope="module")
def mesh(plain_mesh: Mesh) -> Mesh:
    return plain_mesh


def narrowed(spec: dict[str, Any], model: str) -> dict[str, Any]:
    """The served model, and at most MAX_TOKENS new tokens (always given): generation stays cheap. The
    Responses API's budget too: without it a tiny random model writes to the end of its context (75 of
    the positive run's 78 s went to nine such answers)."""
    for name, budget in (("ChatCompletionRequest", "max_tokens"), ("CompletionRequest", "max_tokens"),
                         ("ResponsesRequest", "max_output_tokens"), ("MessagesRequest", "max_tokens")):
        properties = spec["components"]["schemas"][name]["properties"]
        properties["model"] = {"type": "string", "enum": [model]}
        for field in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            if field in properties:
                properties[field] = {"type": "integer", "minimum": 1, "maximum": MAX_TOKENS}
        schema = spec["components"]["schemas"][name]
        schema["required"] = sorted({*schema.get("required", []), budget})  # no default budget
    return spec


def operations(mesh: Mesh, mode: GenerationMode) -> list[Any]:
    """Valid requests from the narrowed schema; invalid ones from the schema as served (what it rules out
    must be refused: the narrowing rules out what the gateway rightly accepts)."""
    spec = httpx.get(f"{mesh.base_url.removesuffix('/v1')}/openapi.json", timeout=10).json()
    model = httpx.get(f"{mesh.base_url}/models", timeout=10).json()["data"][0]["id"]
    schema = schemathesis.openapi.from_dict(narrowed(spec, model) if mode is GenerationMode.POSITIVE else spec)
    return [result.ok() for result in schema.get_all_operations()]


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=lambda m: m.value)
def test_generated_requests_get_documented_answers_and_no_server_error(mesh: Mesh, mode: GenerationMode) -> None:
    base = mesh.base_url.removesuffix("/v1")
    seen: dict[str, int] = {}
    for operation in operations(mesh, mode):
        @settings(max_examples=EXAMPLES, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy(generation_mode=mode))
        def run(case: Any) -> None:
            response = case.call_and_validate(base_url=base, checks=CHECKS, timeout=60)
            seen[case.operation.label] = seen.get(case.operation.label, 0) + 1
            assert response.status_code < 500

        try:
            run()
        except Unsatisfiable:  # no invalid input exists (GET /health; any string is a model name)
            assert mode is GenerationMode.NEGATIVE, operation.label
            seen.setdefault(operation.label, 0)
    assert seen.get("POST /v1/chat/completions") and seen.get("POST /v1/completions"), seen
