"""Tokenizer from artifact resources, sandboxed chat template, streaming detokenization, engine stop strings."""
from __future__ import annotations

import json

import pytest
import torch
from hf_tiny import EOS_ID, IM_END_ID, SPECIALS, build_hf_model, loaded_model, tiny_resources, tokenizer_json

from ninfer_rt.backends.torch_ops import TorchOps
from ninfer_rt.engine import Engine
from ninfer_rt.sampling import SamplingParams
from ninfer_rt.tokenizer import TextStream, Tokenizer, TokenizerError

TEXT = "héllo wörld 😀 <|im_end|> ok"


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_resources(tiny_resources(), eos_token_ids=(EOS_ID,))


def test_resources_give_stop_ids_and_round_trip(tok):
    assert tok.stop_ids == {EOS_ID, IM_END_ID}          # config eos + generation_config + tokenizer eos
    ids = tok.encode(TEXT)
    assert IM_END_ID in ids and tok.decode(ids, skip_special_tokens=False) == TEXT
    assert tok.decode(ids) == TEXT.replace("<|im_end|>", "")
    assert set(SPECIALS.values()) <= tok.special_ids


def test_chat_template_rendering(tok):
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.render_chat(msgs) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    assert tok.render_chat(msgs, enable_thinking=False).endswith("<think>\n\n</think>\n\n")
    assert tok.render_chat(msgs, add_generation_prompt=False) == "<|im_start|>user\nhi<|im_end|>\n"


@pytest.mark.parametrize("template,message", [
    ("{{ ''.__class__.__mro__ }}", "unsafe"),
    ("{{ cycler.__init__.__globals__ }}", "unsafe"),
    ("{{ raise_exception('no system role') }}", "no system role"),
    ("{% for %}", "chat_template.jinja"),
], ids=["dunder", "globals", "raise_exception", "syntax"])
def test_template_is_sandboxed_and_errors_are_one_line(template, message):
    t = Tokenizer(tokenizer_json(), chat_template=template)
    with pytest.raises(TokenizerError, match=message) as e:
        t.render_chat([{"role": "user", "content": "x"}])
    assert "\n" not in str(e.value)


def test_tojson_keeps_unicode():
    t = Tokenizer(tokenizer_json(), chat_template="{{ messages[0] | tojson }}")
    assert json.loads(t.render_chat([{"role": "user", "content": "é\"x"}], add_generation_prompt=False)) == \
        {"role": "user", "content": "é\"x"}


def test_missing_or_broken_resources():
    with pytest.raises(TokenizerError, match="tokenizer.json: missing"):
        Tokenizer.from_resources({})
    with pytest.raises(TokenizerError, match="tokenizer.json: cannot be parsed"):
        Tokenizer.from_resources({"tokenizer.json": b"{bad"})
    with pytest.raises(TokenizerError, match="generation_config.json: invalid JSON"):
        Tokenizer.from_resources({"tokenizer.json": tokenizer_json(), "generation_config.json": b"[1"})
    with pytest.raises(TokenizerError, match="no chat template"):
        Tokenizer(tokenizer_json()).render_chat([])


def test_stream_never_splits_characters(tok):
    ids = tok.encode(TEXT)
    s = TextStream(tok)
    parts = [s.push([i]) for i in ids] + [s.flush()]
    assert "".join(parts) == tok.decode(ids)
    assert not any("\ufffd" in p for p in parts)


@pytest.mark.parametrize("stop,expect", [("wörld", "héllo "), ("😀", "héllo wörld "), ("zz", None)],
                         ids=["multibyte-stop", "emoji-stop", "no-match"])
def test_stream_stop_strings_trim_and_hold_back(tok, stop, expect):
    ids = tok.encode("héllo wörld 😀 z ok")
    s = TextStream(tok, stop=(stop,))
    out = ""
    for i in ids:
        out += s.push([i])
        if not s.stopped:       # released text never ends in a proper prefix of the stop string
            assert not any(out.endswith(stop[:n]) for n in range(1, len(stop)))
    out += s.flush()
    assert out == (expect if expect is not None else tok.decode(ids)) and s.stopped == (expect is not None)


def test_engine_text_deltas_and_stop_strings(tok):
    tiny = build_hf_model(seed=3)
    loaded = loaded_model(tiny)
    prompt = tok.encode(tok.render_chat([{"role": "user", "content": "hi"}]))

    def go(**kw):
        eng = Engine(loaded, TorchOps(), tokenizer=tok)
        eng.add_request("a", prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, **kw))
        ids, text, reason = [], "", None
        while eng.has_work():
            for o in eng.step():
                ids, text, reason = ids + o.new_token_ids, text + o.text, o.finish_reason
        return ids, text, reason

    with torch.no_grad():
        ids, text, reason = go()
        assert text == tok.decode(ids) and reason == "length"
        # random weights emit invalid UTF-8 too: pick a clean two-character stop string
        stop = next(text[i:i + 2] for i in range(3, len(text) - 1) if "\ufffd" not in text[i:i + 2])
        ids2, text2, reason2 = go(stop=[stop])
    assert reason2 == "stop" and text2 == text[:text.find(stop)] and ids2 == ids[:len(ids2)]
    assert len(ids2) < len(ids)
