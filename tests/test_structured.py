"""Structured output (ninfer_rt/grammar.py): grammar masks by output position, with and without MTP, against a
step-by-step reference over HF's logits and xgrammar's own matcher; the API's response_format and guided_*
fields on the real engine's server; what cannot work is a 400 naming the field."""
from __future__ import annotations

import json
import re

import pytest
import torch
from hf_tiny import build_hf_model, loaded_model
from test_server import MODEL_ID, _post, real_srv, tiny_tokenizer  # noqa: F401

from ninfer_rt.backends.torch_ops import TorchOps
from ninfer_rt.engine import Engine
from ninfer_rt import grammar
from ninfer_rt.grammar import GrammarBackend, GrammarError, unpack
from ninfer_rt.sampling import SamplingError, SamplingParams
from ninfer_rt.speculative import SpecConfig

xgr = pytest.importorskip("xgrammar")
pytestmark = pytest.mark.usefixtures("one_thread")

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["red", "green"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["ok", "tag", "n"], "additionalProperties": False}
SPECS = {
    "schema": ("json_schema", json.dumps(SCHEMA)),
    "regex": ("regex", r"[0-9]{2,3}-[a-z]{1,4}"),
    "choice": ("choice", json.dumps(["alpha", "beta", "gamma"])),
    "ebnf": ("grammar", 'root ::= "(" item ("," item){0,3} ")"\nitem ::= [a-c]'),
}


def valid(kind: str, text: str) -> bool:
    if kind == "schema":
        v = json.loads(text)
        return set(v) == {"ok", "tag", "n"} and isinstance(v["ok"], bool) and v["tag"] in ("red", "green") \
            and 0 <= v["n"] <= 99
    if kind == "choice":
        return text in ("alpha", "beta", "gamma")
    return re.fullmatch({"regex": r"[0-9]{2,3}-[a-z]{1,4}", "ebnf": r"\([a-c](,[a-c]){0,3}\)"}[kind], text) is not None


@pytest.fixture(scope="module")
def tiny():
    return build_hf_model(seed=5)


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def run(tiny, tok, k: int, params: list[SamplingParams], prompts) -> dict:
    eng = Engine(loaded_model(tiny), TorchOps(), spec=SpecConfig(num_draft_tokens=k) if k else None, max_batch=4,
                 prefill_chunk=8, tokenizer=tok)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(f"r{i}", p, sp)
    out = {f"r{i}": ([], None) for i in range(len(prompts))}
    while eng.has_work():
        for o in eng.step():
            out[o.req_id] = (out[o.req_id][0] + o.new_token_ids, o.finish_reason if o.finished else None)
    eng.shutdown()
    return out


PROMPTS = ["Answer:", "x", "The list", "ok?"]


@pytest.mark.parametrize("k", [0, 2, 3], ids=["plain", "mtp-2", "mtp-3"])
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_every_output_follows_its_grammar(tiny, tok, k, temperature, monkeypatch):
    monkeypatch.setattr(grammar, "JSON_WHITESPACE", 2)     # the random model pads JSON with every newline allowed
    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=200, structured=SPECS[n])
              for i, n in enumerate(SPECS)]
    out = run(tiny, tok, k, params, [tok.encode(p) for p in PROMPTS])
    for (name, _), (ids, reason) in zip(SPECS.items(), out.values()):
        assert reason == "stop" and ids[-1] in tok.stop_ids | {hf_eos()}, (name, ids)
        text = tok.decode(ids[:-1])
        assert valid(name, text), (name, text)


def hf_eos() -> int:
    import hf_tiny
    return hf_tiny.EOS_ID


def test_greedy_equals_masked_argmax_over_hf_logits(tiny, tok):
    """The reference: HF's logits at each step, xgrammar's mask, argmax; the engine with and without MTP."""
    spec = SPECS["schema"]
    prompt = tok.encode("Answer:")
    backend = GrammarBackend(tok, 256, {hf_eos()} | tok.stop_ids)
    m = xgr.GrammarMatcher(backend.compile(spec))
    bits = xgr.allocate_token_bitmask(1, backend.words * 32)
    lm, ids, want = tiny.causal_lm(), list(prompt), []
    with torch.no_grad():
        while len(want) < 48:
            logits = lm(input_ids=torch.tensor([ids])).logits[0, -1].float()
            m.fill_next_token_bitmask(bits)
            t = int(logits.masked_fill(~unpack(bits, 256)[0], float("-inf")).argmax())
            want.append(t)
            ids.append(t)
            if not m.accept_token(t) or m.is_terminated():
                break
    for k in (0, 3):
        got = run(tiny, tok, k, [SamplingParams(temperature=0, max_tokens=48, structured=spec)], [prompt])["r0"][0]
        assert got == want, k


class CountingMatcher:
    """xgrammar's matcher, counting the mask fills (the costly call)."""
    fills = accepts = 0

    def __init__(self, m):
        self._m = m

    def fill_next_token_bitmask(self, *a):
        CountingMatcher.fills += 1
        return self._m.fill_next_token_bitmask(*a)

    def __getattr__(self, name):
        return getattr(self._m, name)


def test_each_mask_row_is_filled_once_per_round(tiny, tok, monkeypatch):
    """A draft step's row is the verify step's row again: K + 1 fills per round at most, not 1 + 2 + .. + K + 1."""
    make, commit = GrammarBackend.constraint, grammar.Constraint.accept

    def counting(self, *a, **kw):
        c = make(self, *a, **kw)
        c.m = CountingMatcher(c.m)
        return c

    def accept(self, tokens):
        CountingMatcher.accepts += 1
        return commit(self, tokens)
    monkeypatch.setattr(GrammarBackend, "constraint", counting)
    monkeypatch.setattr(grammar.Constraint, "accept", accept)
    monkeypatch.setattr(CountingMatcher, "fills", 0)
    monkeypatch.setattr(CountingMatcher, "accepts", 0)
    want = run(tiny, tok, 0, [SamplingParams(temperature=0, max_tokens=40, structured=SPECS["schema"])], [[5, 6]])
    got = run(tiny, tok, 3, [SamplingParams(temperature=0, max_tokens=40, structured=SPECS["schema"])], [[5, 6]])
    assert got == want
    rounds = CountingMatcher.accepts - len(want["r0"][0])       # the K = 0 run: one commit and one fill per token
    assert 0 < rounds and CountingMatcher.fills - len(want["r0"][0]) <= 4 * rounds, (CountingMatcher.fills, rounds)


def test_draft_rows_walk_forward_and_roll_back(tok):
    backend = GrammarBackend(tok, 256, {hf_eos()} | tok.stop_ids)
    c = backend.constraint(SPECS["regex"])
    drafts = tok.encode("12-") + [tok.encode("9")[0]]          # the 4th draft breaks the grammar
    rows = c.allowed(drafts, "cpu")
    m = xgr.GrammarMatcher(backend.compile(SPECS["regex"]))
    bits = xgr.allocate_token_bitmask(1, backend.words * 32)
    for j in range(4):
        m.fill_next_token_bitmask(bits)
        assert torch.equal(rows[j], unpack(bits, 256)[0]), j
        if j < 3:
            assert m.accept_token(drafts[j])
    assert torch.equal(rows[4], rows[3]) and not rows[3][drafts[3]]       # past the rejected draft: a copy
    assert torch.equal(c.allowed([], "cpu")[0], rows[0])                   # rolled back to the start
    c.accept(tok.encode("7"))
    ref = xgr.GrammarMatcher(backend.compile(SPECS["regex"]))
    assert ref.accept_token(tok.encode("7")[0])
    ref.fill_next_token_bitmask(bits)
    assert torch.equal(c.allowed([], "cpu")[0], unpack(bits, 256)[0])       # "7" went into the matcher


def test_a_grammar_after_the_reasoning_end(tok):
    end = hf_tiny_special("</think>")
    backend = GrammarBackend(tok, 256, {hf_eos()} | tok.stop_ids)
    c = backend.constraint(SPECS["regex"], after=end)
    assert c.allowed(tok.encode("free"), "cpu") is None                     # no row past the end token
    rows = c.allowed(tok.encode("ab") + [end] + tok.encode("1"), "cpu")
    assert rows[:3].all() and not rows[3][ord("a")] and rows[3][ord("1")] and not rows[4][ord("-")]
    c.accept(tok.encode("zz"))
    assert c.allowed([], "cpu") is None
    c.accept([end] + tok.encode("12"))
    assert c.allowed([], "cpu")[0][ord("-")]                              # "12" went into the grammar


def hf_tiny_special(name: str) -> int:
    import hf_tiny
    return hf_tiny.SPECIALS[name]


def test_unpack_equals_xgrammars_own_masking():
    bits = torch.randint(-2**31, 2**31 - 1, (3, 5), dtype=torch.int32, generator=torch.Generator().manual_seed(2))
    bits[0, 0] = -2**31 + 0b1011                     # bit 31 set: the sign bit must count as a token
    x = torch.zeros(3, 150)
    xgr.apply_token_bitmask_inplace(x, bits)
    assert torch.equal(unpack(bits, 150), x == 0) and unpack(bits, 150)[0, [0, 1, 3, 31]].all()


@pytest.mark.parametrize("kw,msg", [
    ({"structured": ("json_schema", "{}"), "ignore_eos": True}, "cannot be combined with ignore_eos"),
    ({"structured": ("json_schema", "{}"), "min_tokens": 2}, "cannot be combined with min_tokens"),
    ({"structured": ("yaml", "x")}, "expected (kind, text)"),
], ids=["ignore-eos", "min-tokens", "kind"])
def test_structured_params_are_checked(kw, msg):
    with pytest.raises(SamplingError, match=re.escape(msg)):
        SamplingParams(max_tokens=8, **kw)


def test_bad_grammar_is_a_grammar_error(tok):
    backend = GrammarBackend(tok, 256, {hf_eos()})
    with pytest.raises(GrammarError, match=r"^regex: cannot be compiled: "):
        backend.compile(("regex", "[unclosed"))


# ---- over the API (the real engine, MTP on) ----
CHAT = [{"role": "user", "content": "hi"}]
API = {
    "json_object": ({"response_format": {"type": "json_object"}}, lambda t: isinstance(json.loads(t), dict)),
    "json_schema": ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
                    lambda t: valid("schema", t)),
    "guided_choice": ({"guided_choice": ["alpha", "beta"]}, lambda t: t in ("alpha", "beta")),
    "guided_regex": ({"guided_regex": "[0-9]{2,3}-[a-z]{1,4}"}, lambda t: valid("regex", t)),
    "structured_outputs": ({"structured_outputs": {"choice": ["alpha", "beta"]}}, lambda t: t in ("alpha", "beta")),
    "llama.cpp-schema": ({"response_format": {"type": "json_object", "schema": SCHEMA}}, lambda t: valid("schema", t)),
}


@pytest.mark.parametrize("case", list(API), ids=list(API))
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"], ids=["chat", "completions"])
def test_api_structured_output(real_srv, case, path):  # noqa: F811
    body = {"model": MODEL_ID, "max_tokens": 200, "temperature": 0, **API[case][0]}
    body.update({"messages": CHAT} if "chat" in path else {"prompt": "Answer:"})
    r = _post(real_srv, path, body)
    assert r.status_code == 200, r.json()
    c = r.json()["choices"][0]
    text = c["message"]["content"] if "chat" in path else c["text"]
    assert c["finish_reason"] == "stop" and API[case][1](text), text
    if "chat" in path:        # the template opens a <think> block: the grammar starts after its end
        assert c["message"]["reasoning_content"]


@pytest.mark.parametrize("extra,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"guided_regex": "[unclosed"}, "guided_regex"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"guided_choice": ["a"], "ignore_eos": True}, "guided_choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs.choice"),
    ({"structured_outputs": {"choice": "ab"}}, "structured_outputs.choice"),
    ({"guided_choice": ["a", 1]}, "guided_choice"),
    ({"structured_outputs": {"backend": "x"}}, "structured_outputs.backend"),
    ({"structured_outputs": {"structural_tag": "{x"}}, "structured_outputs.structural_tag"),
    ({"response_format": {"type": "structural_tag", "triggers": ["<a"]}}, "response_format.structures"),
    ({"response_format": {"type": "structural_tag", "triggers": ["<a"], "structures": [{"begin": "<b>"}]}},
     "response_format.structures.0"),
    ({"response_format": {"type": "structural_tag", "triggers": ["<a"], "structures": [
        {"begin": "<b>", "schema": {}, "end": "</b>"}]}}, "response_format"),        # xgrammar: no trigger matches
], ids=["bad-schema", "bad-type", "no-schema", "bad-regex", "two", "ignore-eos", "two-vllm", "choice-not-list",
        "choice-not-strings", "unknown-key", "tag-not-json", "tag-no-structures", "tag-bad-structure",
        "tag-no-trigger"])
def test_api_structured_errors(real_srv, extra, param):  # noqa: F811
    r = _post(real_srv, "/v1/chat/completions", {"model": MODEL_ID, "messages": CHAT, "max_tokens": 8, **extra})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param, err
    assert err["message"].startswith(param) and "\n" not in err["message"]


# ---- forced tool calls (tool_choice "required" / a named function): a grammar of the call format ----
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}}}}}
NOOP = {"type": "function", "function": {"name": "noop"}}


@pytest.mark.parametrize("choice,parallel", [("required", True), ("required", False),
                                             ({"type": "function", "function": {"name": "get_weather"}}, True)],
                         ids=["required", "required-one", "named"])
def test_forced_tool_calls(real_srv, choice, parallel):  # noqa: F811
    r = _post(real_srv, "/v1/chat/completions", {
        "model": MODEL_ID, "messages": CHAT, "max_tokens": 200, "temperature": 0, "tools": [WEATHER, NOOP],
        "tool_choice": choice, "parallel_tool_calls": parallel,
        "chat_template_kwargs": {"enable_thinking": False}})
    assert r.status_code == 200, r.json()
    c = r.json()["choices"][0]
    calls = c["message"].get("tool_calls") or []
    assert c["finish_reason"] == "tool_calls" and calls and (parallel or len(calls) == 1), c
    for call in calls:
        args = json.loads(call["function"]["arguments"])
        assert call["function"]["name"] in (["get_weather"] if isinstance(choice, dict) else ["get_weather", "noop"])
        assert set(args) <= {"city", "days"}


def accepts(backend, spec: tuple, text: str, tok) -> bool:
    """The grammar takes the whole text (as the tiny tokenizer's tokens); it may go on after it."""
    m = xgr.GrammarMatcher(backend.compile(spec))
    return all(m.accept_token(t) for t in tok.encode(text))


def forced(tools, name=None, parallel=False) -> tuple:
    from ninfer_rt.server.tool_calls import call_tag
    return ("structural_tag", call_tag(tools, name, parallel))


def call(name: str, **args) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in args.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


RICH = {"type": "function", "function": {"name": "book", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "nights": {"type": "integer"}, "pets": {"type": "boolean"},
    "room": {"type": "object", "properties": {"view": {"enum": ["sea", "city"]}}, "required": ["view"]},
    "notes": {"type": ["string", "null"]}}, "required": ["city", "nights"], "additionalProperties": False}}}


@pytest.mark.parametrize("text,ok", [
    (call("book", city="Paris", nights=3), True),
    (call("book", city="Paris", nights=3, pets="true", room='{"view": "sea"}', notes="late"), True),
    (call("book", city="Paris"), False),                                   # a required parameter left out
    (call("book", nights=3, city="Paris"), False),                         # not the schema's order
    (call("book", city="Paris", nights="3.5"), False),                     # integer
    (call("book", city="Paris", nights=3, pets="yes"), False),             # boolean
    (call("book", city="Paris", nights=3, room='{"view": "garden"}'), False),     # enum inside an object
    (call("book", city="Paris", nights=3, extra="1"), False),              # additionalProperties: false
    (call("book", city="<b>Paris</b> </para x", nights=3), True),          # markup is text
    (call("book", city="Paris</function>x", nights=3), False),             # the format's own tags are not
    (call("book", city="a<parameter=b", nights=3), False),
    (call("book", city="a</tool_call>", nights=3), False),
    (call("book", city="P", nights=3, room='{"view": "sea", "x": "</function>"}'), False),
], ids=["required", "all", "missing-required", "order", "int", "bool", "nested-enum", "extra", "markup",
        "function-tag", "parameter-tag", "call-tag", "nested-tag"])
def test_forced_call_follows_the_parameter_schema(tok, text, ok):
    backend = GrammarBackend(tok, 256, {hf_eos()} | tok.stop_ids)
    assert accepts(backend, forced([RICH]), text, tok) is ok


def test_forced_call_without_parameters_and_the_end(tok):
    backend = GrammarBackend(tok, 256, {hf_eos()} | tok.stop_ids)
    m = xgr.GrammarMatcher(backend.compile(forced([WEATHER, NOOP], "noop")))
    assert all(m.accept_token(t) for t in tok.encode(call("noop")))
    assert not m.accept_token(tok.encode("\n")[0]) and m.accept_token(hf_eos())        # one call, then the end
    assert not accepts(backend, forced([WEATHER, NOOP], "noop"), call("noop", x=1), tok)   # no parameters at all
    assert not accepts(backend, forced([WEATHER, NOOP], "noop"), call("get_weather", city="A"), tok)
    assert not accepts(backend, forced([WEATHER, NOOP], parallel=True), "I", tok)       # no text before a call
    two = call("get_weather", city="A", days=-12) + "\n" + call("noop")
    assert accepts(backend, forced([WEATHER, NOOP], parallel=True), two, tok)
    assert not accepts(backend, forced([WEATHER, NOOP], parallel=False), two, tok)


def test_forced_call_with_a_bad_parameter_schema_names_the_tool(real_srv):  # noqa: F811
    bad = {"type": "function", "function": {"name": "bad", "parameters": {"type": "object", "properties": {
        "x": {"type": "objectx"}}}}}
    r = _post(real_srv, "/v1/chat/completions", {"model": MODEL_ID, "messages": CHAT, "max_tokens": 8,
                                                 "tools": [WEATHER, bad], "tool_choice": "required"})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "tools.1.function.parameters", err
    assert "objectx" in err["message"] and "\n" not in err["message"]


# ---- structural tags (vLLM's structured_outputs.structural_tag, response_format "structural_tag") ----
LEGACY_TAG = {"type": "structural_tag", "triggers": ["<fn="], "structures": [
    {"begin": "<fn=get>", "schema": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
     "end": "</fn>"}]}


@pytest.mark.parametrize("text,ok", [
    ('hi <fn=get>{"a": 1}</fn> bye', True), ("no call at all", True), ('hi <fn=get>{"a": "x"}</fn>', False),
    ('<fn=put>{"a": 1}</fn>', False)], ids=["call", "free", "bad-value", "unknown-tag"])
def test_legacy_structural_tag_is_triggered_tags(tok, text, ok):
    from ninfer_rt.server.structured_api import structural_tag
    backend = GrammarBackend(tok, 256, {hf_eos()} | tok.stop_ids)
    for given in (LEGACY_TAG, json.dumps(LEGACY_TAG)):
        assert accepts(backend, ("structural_tag", structural_tag(given, "f")), text, tok) is ok


@pytest.mark.parametrize("how", ["response_format", "structured_outputs"])
def test_api_structural_tag(real_srv, how):  # noqa: F811
    tag = {"type": "structural_tag", "format": {"type": "tag", "begin": "<x>", "end": "</x>",
                                                "content": {"type": "json_schema", "json_schema": SCHEMA}}}
    extra = {"response_format": tag} if how == "response_format" else {"structured_outputs": {
        "structural_tag": json.dumps(tag)}}
    r = _post(real_srv, "/v1/chat/completions", {"model": MODEL_ID, "messages": CHAT, "max_tokens": 60,
                                                 "temperature": 0, "chat_template_kwargs": {"enable_thinking": False},
                                                 **extra})
    c = r.json()["choices"][0]
    text = c["message"]["content"]
    assert r.status_code == 200 and c["finish_reason"] == "stop", c
    assert text.startswith("<x>") and text.endswith("</x>") and valid("schema", text[3:-4]), text


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_structured_on_captured_graphs_equals_eager_gpu(tmp_path_factory, tok, monkeypatch):
    """bf16 Triton kernels, MTP K = 3: grammar masks on the captured-graph engine give the eager engine's tokens,
    and every output follows its grammar."""
    monkeypatch.setattr(grammar, "JSON_WHITESPACE", 2)
    import sys
    from pathlib import Path
    sys.path.append(str(Path(__file__).resolve().parents[1] / "bench"))
    import synth_artifact as synth

    from ninfer_rt.backends.triton_ops import TritonOps
    from ninfer_rt.loader import load
    paths, _ = synth.build(str(tmp_path_factory.mktemp("nvfp4")), synth.TINY, "nvfp4", workers=1)
    names = ["schema", "regex", "choice"]
    outs = []
    for mode in ("eager", "auto"):
        lm = load(paths[0], device="cuda", dtype=torch.bfloat16)
        eng = Engine(lm, TritonOps(), spec=SpecConfig(num_draft_tokens=3), max_batch=4, kv_pages=64,
                     prefill_chunk=16, graphs=mode, grammar_tokenizer=tok)
        for i, n in enumerate(names):
            eng.add_request(f"r{i}", tok.encode(PROMPTS[i]), SamplingParams(temperature=0, max_tokens=120,
                                                                             structured=SPECS[n]))
        # no tokenizer on this engine and no stop_token_ids: the grammar's stop tokens end the requests
        out = {f"r{i}": [] for i in range(len(names))}
        while eng.has_work():
            for o in eng.step():
                out[o.req_id] += o.new_token_ids
        outs.append(out)
        eng.shutdown()
    assert outs[0] == outs[1]
    for i, n in enumerate(names):
        ids = outs[1][f"r{i}"]
        assert ids[-1] in tok.stop_ids | {hf_eos(), *lm.config.eos_token_ids} and valid(n, tok.decode(ids[:-1])), \
            (n, tok.decode(ids))
