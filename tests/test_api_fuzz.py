"""Each API driven from its /openapi.json alone (schemathesis against the live mesh: `aflex up`, a tiny model).

Every operation gets generated requests, valid ones and invalid ones (schemathesis's positive and negative
modes, a bounded number of examples each). A valid request must get a 200 whose body is the documented
one; an invalid one a 4xx in the API's error shape (OpenAI's, or Anthropic's on /v1/messages); no request
a 5xx. The schema is the served one, narrowed only where the answer would cost too much or a rule holds
that JSON Schema cannot state, each said in `narrowed`.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import httpx2 as httpx
import jsonschema
import pytest
import schemathesis
from hypothesis import HealthCheck, assume, given, settings
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

EXAMPLES = int(os.environ.get("AFLEX_FUZZ_EXAMPLES", "25"))  # per operation and mode
MAX_TOKENS = 4
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          negative_data_rejection]
APIS = ("POST /v1/chat/completions", "POST /v1/completions", "POST /v1/responses", "POST /v1/messages",
        "POST /v1/messages/count_tokens")


@pytest.fixture(scope="module")
def mesh(plain_mesh: Mesh) -> Mesh:
    return plain_mesh


def _walk(schema: Any, visit: Any) -> None:
    """Visit each schema in `schema`, but not the conditions of its rules between fields (`if`, `not`, ...)."""
    if isinstance(schema, dict):
        visit(schema)
        for key, value in schema.items():
            if key not in ("if", "then", "else", "not", "contains"):
                _walk(value, visit)
    elif isinstance(schema, list):
        for value in schema:
            _walk(value, visit)


def _request_schemas(spec: dict[str, Any]) -> set[str]:
    """The component schemas requests are made of (their bodies', and those they refer to)."""
    names: set[str] = set()
    todo = [op["requestBody"] for methods in spec["paths"].values() for op in methods.values() if "requestBody" in op]

    def refer(schema: dict[str, Any]) -> None:
        if isinstance(schema.get("$ref"), str):
            name = schema["$ref"].rsplit("/", 1)[-1]
            if name not in names:
                names.add(name)
                todo.append(spec["components"]["schemas"][name])

    while todo:
        _walk(todo.pop(), refer)
    return names


def narrowed(spec: dict[str, Any], model: str) -> dict[str, Any]:
    """The served schema, narrowed where it must be for valid requests to be cheap and served:
    - the served model (any other is a 404), and at most MAX_TOKENS new tokens, always given: without a
      budget a tiny random model writes to the end of its context (75 of a run's 78 s once went to nine such
      answers); min_tokens no more than that budget (a rule between two numbers);
    - short conversations and texts, so that a prompt fits the context (1024 tokens here);
    - a forced call names no function, tools have one function each, and a JSON Schema to follow is any
      object: a named function must be one of the tools, names are unique, and a schema must compile,
      rules the server checks and JSON Schema cannot state; a function's name is one of two (Python's regex
      `$` matches before a final newline, so a generator may write a name the server rightly refuses);
    - a completion's prompt text holds a letter or digit: one of control characters only has no tokens, an
      empty prompt the tokenizer knows of, not the schema."""
    schemas = spec["components"]["schemas"]
    for parameter in spec["paths"]["/v1/models/{model}"]["get"]["parameters"]:
        parameter["schema"] = {"type": "string", "enum": [model]}
    for name in ("TokenizeRequest", "DetokenizeRequest", "CountTokensRequest"):
        schemas[name]["properties"]["model"] = {"type": "string", "enum": [model]}
    for name, budget in (("ChatCompletionRequest", "max_tokens"), ("CompletionRequest", "max_tokens"),
                         ("ResponsesRequest", "max_output_tokens"), ("MessagesRequest", "max_tokens")):
        properties = schemas[name]["properties"]
        properties["model"] = {"type": "string", "enum": [model]}
        for field in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            if field in properties:
                properties[field] = {"type": "integer", "minimum": 1, "maximum": MAX_TOKENS}
        if "min_tokens" in properties:
            properties["min_tokens"] = {"type": "integer", "minimum": 0, "maximum": 1}
        schemas[name]["required"] = sorted({*schemas[name].get("required", []), budget})

    def short(schema: dict[str, Any]) -> None:  # and integers within 2**53: the generator's floats hold them
        if schema.get("type") == "integer":
            schema["maximum"] = min(schema.get("maximum", 2**53), 2**53)
            schema["minimum"] = max(schema.get("minimum", -(2**53)), -(2**53))
        if schema.get("type") == "string" and "enum" not in schema and "pattern" not in schema:
            schema["maxLength"] = 16
        if schema.get("type") == "array":
            schema["maxItems"] = min(schema.get("maxItems", 2), 2)
        if schema.get("type") == "object" and "properties" not in schema:  # a free-form object
            schema["maxProperties"] = 2

    for name in _request_schemas(spec):
        _walk(schemas[name], short)
    prompt = schemas["CompletionRequest"]["properties"]["prompt"]["anyOf"]
    for branch in prompt:  # a prompt text with something to tokenize (a lone control character has no tokens)
        _walk(branch, lambda schema: schema.update(pattern="[A-Za-z0-9]") if schema.get("type") == "string" else None)
    for name in ("ChatCompletionRequest", "ResponsesRequest"):
        schemas[name]["properties"]["tool_choice"] = {"enum": ["none", "auto", "required", None]}
        schemas[name]["properties"]["tools"] = {"anyOf": [
            {"type": "array", "maxItems": 1, "items": schemas[name]["properties"]["tools"]["anyOf"][0]["items"]},
            {"type": "null"}]}
    for name in ("MessagesRequest", "CountTokensRequest"):
        schemas[name]["properties"]["tools"] = {"anyOf": [
            {"type": "array", "maxItems": 1, "items": schemas[name]["properties"]["tools"]["anyOf"][0]["items"]},
            {"type": "null"}]}
        schemas[name]["properties"]["tool_choice"] = {"anyOf": [{"type": "null"}, {"allOf": [
            {"$ref": "#/components/schemas/ToolChoice"}, {"properties": {"type": {"enum": ["auto", "any", "none"]}}}]}]}
    for name in ("FunctionSpec", "FunctionTool", "ClientTool"):
        schemas[name]["properties"]["name"] = {"enum": ["get_weather", "lookup"]}
    for name, field in (("JsonSchemaSpec", "schema"), ("TextFormat", "schema")):
        schemas[name]["properties"][field] = {"const": {"type": "object"}}
    for name, field in (("FunctionSpec", "parameters"), ("FunctionTool", "parameters"), ("ClientTool", "input_schema")):
        schemas[name]["properties"][field] = {"anyOf": [{"type": "null"}, {"const": {"type": "object"}}]}
    return spec


def operations(mesh: Mesh, mode: GenerationMode) -> tuple[list[Any], dict[str, Any]]:
    """Valid requests from the narrowed schema; invalid ones from the schema as served (what it rules out
    must be refused: the narrowing rules out what the gateway rightly accepts). And the spec they came from."""
    spec = httpx.get(f"{mesh.base_url.removesuffix('/v1')}/openapi.json", timeout=10).json()
    model = httpx.get(f"{mesh.base_url}/models", timeout=10).json()["data"][0]["id"]
    spec = narrowed(spec, model) if mode is GenerationMode.POSITIVE else spec
    schema = schemathesis.openapi.from_dict(copy.deepcopy(spec))  # it may rewrite what it reads
    return [result.ok() for result in schema.get_all_operations()], spec


def body_validator(spec: dict[str, Any], path: str, method: str) -> jsonschema.Validator | None:
    """The operation's request body schema (its rules between fields included), as a validator."""
    body = spec["paths"][path][method.lower()].get("requestBody")
    if body is None:
        return None
    schema = {"components": spec["components"], "allOf": [body["content"]["application/json"]["schema"]]}
    return jsonschema.Draft202012Validator(schema)


def _error_shape(path: str, status: int, body: Any) -> bool:
    kind = "not_found_error" if status == 404 else "invalid_request_error"
    if path.startswith("/v1/messages"):
        return body.get("type") == "error" and body["error"]["type"] == kind
    return body["error"]["type"] == kind and isinstance(body["error"]["message"], str)


def drive(operation: Any, mode: GenerationMode, base: str, valid: jsonschema.Validator | None,
          seen: dict[str, int]) -> None:
    """Up to EXAMPLES generated requests of `operation`, each answered as its validity says."""

    @settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case: Any) -> None:
        if mode is GenerationMode.POSITIVE and valid is not None:  # the generator may miss an if/then rule
            assume(valid.is_valid(case.body))
        response = case.call_and_validate(base_url=base, checks=CHECKS, timeout=60)
        label = case.operation.label
        seen[label] = seen.get(label, 0) + 1
        if mode is GenerationMode.POSITIVE:
            assert response.status_code == 200, (label, case.body, response.text)
        elif response.status_code != 200 and label in APIS:
            assert response.status_code in (400, 404, 413), (label, case.body, response.text)
            assert _error_shape(case.operation.path, response.status_code, response.json()), response.text

    try:
        run()
    except Unsatisfiable:  # no invalid input exists (GET /health; any string is a model name)
        assert mode is GenerationMode.NEGATIVE, operation.label
        seen.setdefault(operation.label, 0)


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=lambda m: m.value)
def test_each_api_from_its_schema_alone(mesh: Mesh, mode: GenerationMode) -> None:
    seen: dict[str, int] = {}
    found, spec = operations(mesh, mode)
    for operation in found:
        valid = body_validator(spec, operation.path, operation.method)
        drive(operation, mode, mesh.base_url.removesuffix("/v1"), valid, seen)
    assert all(seen.get(label) for label in APIS), seen
