"""Structured output fields of a request (OpenAI's `response_format`, llama.cpp's `response_format.schema`, vLLM's
`structured_outputs` and older `guided_*`, a forced tool call) -> `SamplingParams.structured`, checked under the
request's own field names."""
from __future__ import annotations

import json

from ninfer_formats.errors import NinferError

from .protocol import ChatRequest, _Sampling, bad_request, forced_tool, template_tools
from .tool_calls import call_tag

# vLLM's request fields (the older guided_* names, and the structured_outputs object that replaced them) -> kind
_GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}
_VLLM = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
         "structural_tag": "structural_tag"}
# vLLM's backend switches: xgrammar is the only backend here, with its own whitespace rule (grammar.JSON_WHITESPACE)
_VLLM_OPTIONS = ("json_object", "disable_fallback", "disable_any_whitespace", "disable_additional_properties",
                 "whitespace_pattern")


def _given(req: _Sampling) -> list[tuple[str, str, object]]:
    """(field, kind, value) of every structured-output field the request sets."""
    out = []
    if isinstance(req, ChatRequest) and (forced := forced_tool(req)) is not False:
        tag = call_tag(template_tools(req), None if forced is True else forced, req.parallel_tool_calls is not False)
        out.append(("tool_choice", "structural_tag", tag))
    if req.response_format is not None and req.response_format.get("type") != "text":
        out.append(("response_format", *_response_format(req.response_format)))
    out += [(f, kind, getattr(req, f)) for f, kind in _GUIDED.items() if getattr(req, f) is not None]
    so = req.structured_outputs or {}
    unknown = next((k for k in so if k not in _VLLM and k not in _VLLM_OPTIONS), None)
    if unknown is not None:
        raise bad_request(f"structured_outputs.{unknown}: not supported by this server (json, regex, choice, "
                          f"grammar, structural_tag, json_object)", param=f"structured_outputs.{unknown}")
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
    if kind == "structural_tag":
        return (kind, structural_tag(v, f)), f
    if kind == "choice":
        if not isinstance(v, list) or not v or not all(isinstance(c, str) and c for c in v):
            raise bad_request(f"{f}: expected a list of non-empty strings", param=f)
        return (kind, json.dumps(v)), f
    if not isinstance(v, str) or not v:
        raise bad_request(f"{f}: expected a non-empty string", param=f)
    return (kind, v), f


def blame(req: _Sampling, field: str, compile_spec) -> str:
    """The field to name for a grammar that does not compile: a forced call's grammar holds every tool's parameter
    schema, so the first tool whose own call grammar fails is named (`compile_spec` raises for a bad spec)."""
    if field != "tool_choice":
        return field
    for i, tool in enumerate(template_tools(req)):
        try:
            compile_spec(("structural_tag", call_tag([tool])))
        except NinferError:                # GrammarError
            return f"tools.{i}.function.parameters"
    return field


def _response_format(fmt: dict) -> tuple[str, object]:
    """OpenAI's json_object / json_schema, and llama.cpp's json_object with a `schema`."""
    kind = fmt.get("type")
    if kind == "json_object":
        schema = fmt.get("schema", {"type": "object"})
        if not isinstance(schema, dict):
            raise bad_request("response_format.schema: expected a JSON schema object", param="response_format.schema")
        return ("json_schema", schema)
    if kind == "structural_tag":
        return ("structural_tag", fmt)
    if kind != "json_schema":
        raise bad_request(f"response_format.type: expected 'text', 'json_object', 'json_schema' or 'structural_tag', "
                          f"got {kind!r}", param="response_format.type")
    spec = fmt.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise bad_request("response_format.json_schema.schema: expected a JSON schema object",
                          param="response_format.json_schema.schema")
    return ("json_schema", schema)


def structural_tag(v, field: str) -> str:
    """xgrammar's structural tag (an object with a `format`, or its text, as vLLM takes it) -> its JSON text. The
    older shape (`structures` of begin / JSON schema / end, and `triggers`: OpenAI-style `response_format`) becomes
    the same triggered tags: free text until a trigger, then one of the structures."""
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except ValueError:
            raise bad_request(f"{field}: not valid JSON", param=field) from None
    if not isinstance(v, dict):
        raise bad_request(f"{field}: expected a structural tag object", param=field)
    if "format" in v:
        return json.dumps({"type": "structural_tag", "format": v["format"]}, ensure_ascii=False)
    structures, triggers = v.get("structures"), v.get("triggers")
    if not isinstance(structures, list) or not structures:
        raise bad_request(f"{field}.structures: expected a non-empty list (or give a `format`)",
                          param=f"{field}.structures")
    if not isinstance(triggers, list) or not all(isinstance(t, str) and t for t in triggers):
        raise bad_request(f"{field}.triggers: expected a list of non-empty strings", param=f"{field}.triggers")
    tags = []
    for i, st in enumerate(structures):
        if not (isinstance(st, dict) and isinstance(st.get("begin"), str) and isinstance(st.get("end"), str)
                and isinstance(st.get("schema"), dict)):
            raise bad_request(f"{field}.structures.{i}: expected begin and end strings and a JSON schema object",
                              param=f"{field}.structures.{i}")
        tags.append({"type": "tag", "begin": st["begin"], "end": st["end"],
                     "content": {"type": "json_schema", "json_schema": st["schema"]}})
    fmt = {"type": "triggered_tags", "triggers": triggers, "tags": tags}
    return json.dumps({"type": "structural_tag", "format": fmt}, ensure_ascii=False)
