"""Structured output fields of a request (OpenAI's `response_format`, llama.cpp's `response_format.schema`, vLLM's
`structured_outputs` and older `guided_*`, a forced tool call) -> `SamplingParams.structured`, checked under the
request's own field names."""
from __future__ import annotations

import json

from .protocol import ChatRequest, _Sampling, bad_request, forced_tool, template_tools
from .tool_calls import call_grammar

# vLLM's request fields (the older guided_* names, and the structured_outputs object that replaced them) -> kind
_GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}
_VLLM = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}
# vLLM's backend switches: xgrammar is the only backend here, with its own whitespace rule (grammar.JSON_WHITESPACE)
_VLLM_OPTIONS = ("json_object", "disable_fallback", "disable_any_whitespace", "disable_additional_properties",
                 "whitespace_pattern")


def _given(req: _Sampling) -> list[tuple[str, str, object]]:
    """(field, kind, value) of every structured-output field the request sets."""
    out = []
    if isinstance(req, ChatRequest) and (forced := forced_tool(req)) is not False:
        grammar = call_grammar(template_tools(req), None if forced is True else forced,
                               req.parallel_tool_calls is not False)
        out.append(("tool_choice", "grammar", grammar))
    if req.response_format is not None and req.response_format.get("type") != "text":
        out.append(("response_format", *_response_format(req.response_format)))
    out += [(f, kind, getattr(req, f)) for f, kind in _GUIDED.items() if getattr(req, f) is not None]
    so = req.structured_outputs or {}
    unknown = next((k for k in so if k not in _VLLM and k not in _VLLM_OPTIONS), None)
    if unknown is not None:
        raise bad_request(f"structured_outputs.{unknown}: not supported by this server (json, regex, choice, "
                          f"grammar, json_object)", param=f"structured_outputs.{unknown}")
    out += [(f"structured_outputs.{k}", _VLLM[k], v) for k, v in so.items() if k in _VLLM and v is not None]
    if so.get("json_object"):
        out.append(("structured_outputs.json_object", "json_schema", {"type": "object"}))
    return out


def structured(req: _Sampling) -> tuple[tuple, str | None]:
    """-> (SamplingParams.structured, the request field that set it); ((), None) for free text."""
    given = _given(req)
    if len(given) > 1:
        raise bad_request(f"{given[1][0]}: only one way of structuring the output may be given (also got "
                          f"{given[0][0]})", param=given[1][0])
    if not given:
        return (), None
    f, kind, v = given[0]
    if kind == "json_schema":
        if not isinstance(v, (str, dict)):
            raise bad_request(f"{f}: expected a JSON schema (an object, or its text)", param=f)
        return (kind, v if isinstance(v, str) else json.dumps(v)), f
    if kind == "choice":
        if not isinstance(v, list) or not v or not all(isinstance(c, str) and c for c in v):
            raise bad_request(f"{f}: expected a list of non-empty strings", param=f)
        return (kind, json.dumps(v)), f
    if not isinstance(v, str) or not v:
        raise bad_request(f"{f}: expected a non-empty string", param=f)
    return (kind, v), f


def _response_format(fmt: dict) -> tuple[str, object]:
    """OpenAI's json_object / json_schema, and llama.cpp's json_object with a `schema`."""
    kind = fmt.get("type")
    if kind == "json_object":
        schema = fmt.get("schema", {"type": "object"})
        if not isinstance(schema, dict):
            raise bad_request("response_format.schema: expected a JSON schema object", param="response_format.schema")
        return ("json_schema", schema)
    if kind != "json_schema":
        raise bad_request(f"response_format.type: expected 'text', 'json_object' or 'json_schema', got {kind!r}",
                          param="response_format.type")
    spec = fmt.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise bad_request("response_format.json_schema.schema: expected a JSON schema object",
                          param="response_format.json_schema.schema")
    return ("json_schema", schema)
