"""Structured output fields of a request (OpenAI's `response_format`, vLLM's `guided_*`, a forced tool call) ->
`SamplingParams.structured`, checked under the request's own field names."""
from __future__ import annotations

import json

from .protocol import ChatRequest, _Sampling, bad_request, forced_tool, template_tools
from .tool_calls import call_grammar

_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def structured(req: _Sampling) -> tuple[tuple, str | None]:
    """-> (SamplingParams.structured, the request field that set it); ((), None) for free text."""
    given = [f for f in ("response_format",) + _GUIDED if getattr(req, f) is not None]
    given = [f for f in given if not (f == "response_format" and req.response_format.get("type") == "text")]
    forced = forced_tool(req) if isinstance(req, ChatRequest) else False
    if forced is not False:
        given.insert(0, "tool_choice")
    if len(given) > 1:
        raise bad_request(f"{given[1]}: only one of response_format and the guided_* fields may be given "
                          f"(also got {given[0]})", param=given[1])
    if not given:
        return (), None
    f = given[0]
    v = getattr(req, f)
    if f == "tool_choice":
        return ("grammar", call_grammar(template_tools(req), None if forced is True else forced,
                                        req.parallel_tool_calls is not False)), f
    if f == "response_format":
        return _response_format(v), f
    if f == "guided_json":
        return ("json_schema", v if isinstance(v, str) else json.dumps(v)), f
    if f == "guided_choice":
        if not v or not all(isinstance(c, str) and c for c in v):
            raise bad_request("guided_choice: expected a list of non-empty strings", param=f)
        return ("choice", json.dumps(v)), f
    if not v:
        raise bad_request(f"{f}: must not be empty", param=f)
    return ("regex" if f == "guided_regex" else "grammar", v), f


def _response_format(fmt: dict) -> tuple:
    kind = fmt.get("type")
    if kind == "json_object":
        return ("json_schema", '{"type": "object"}')
    if kind != "json_schema":
        raise bad_request(f"response_format.type: expected 'text', 'json_object' or 'json_schema', got {kind!r}",
                          param="response_format.type")
    spec = fmt.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise bad_request("response_format.json_schema.schema: expected a JSON schema object",
                          param="response_format.json_schema.schema")
    return ("json_schema", json.dumps(schema))
