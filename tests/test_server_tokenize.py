"""vLLM's server extras: `POST /tokenize` (a prompt, or chat messages through the template) and `POST /detokenize`
on the FakeEngine server (they never touch the engine), `stop_token_ids` on the real Engine, and
generation_config's repetition_penalty as a default."""
from __future__ import annotations

import pytest
from test_server import CHAT, MODEL_ID, _post, fake, real_srv, tiny_tokenizer  # noqa: F401


def test_tokenize_a_prompt_and_back(fake):
    srv, _, _ = fake
    text = "héllo <|im_end|> 漢"
    r = _post(srv, "/tokenize", {"model": MODEL_ID, "prompt": text})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tiny_tokenizer().encode(text) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == srv.scheduler.max_context
    back = _post(srv, "/detokenize", {"model": MODEL_ID, "tokens": body["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": text}       # special tokens kept


@pytest.mark.parametrize("gen", [True, False], ids=["generation-prompt", "no-generation-prompt"])
def test_tokenize_messages_is_the_chat_prompt(fake, gen):
    srv, _, _ = fake
    body = {"messages": CHAT["messages"], "add_generation_prompt": gen,
            "chat_template_kwargs": {"enable_thinking": False}}
    ids = _post(srv, "/tokenize", body).json()["tokens"]
    text = tiny_tokenizer().decode(ids, skip_special_tokens=False)
    assert text.startswith("<|im_start|>user\nhello<|im_end|>\n")
    assert text.endswith("<think>\n\n</think>\n\n") if gen else text.endswith("<|im_end|>\n")


@pytest.mark.parametrize("path,body,status,param", [
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, 400, None),
    ("/tokenize", {}, 400, None),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, 400, "messages.0.content.0.text"),
    ("/tokenize", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "messages.0.content.0"),
    ("/tokenize", {"model": "other", "prompt": "a"}, 404, "model"),
    ("/detokenize", {"tokens": [1, 999]}, 400, "tokens"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
], ids=["both", "neither", "prompt-type", "no-messages", "part-without-text", "image-part", "wrong-model",
        "out-of-vocab", "tokens-type"])
def test_tokenize_errors(fake, path, body, status, param):
    srv, _, _ = fake
    r = _post(srv, path, body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["message"]


@pytest.mark.parametrize("ignore_eos", [False, True], ids=["eos", "ignore-eos"])
def test_stop_token_ids_end_the_output(real_srv, ignore_eos):
    """A stop token id ends the output at its first occurrence; as vLLM, it counts and has its logprob but is left
    out of the text. It applies with ignore_eos too, which only drops the model's own stop tokens."""
    import hf_tiny
    c = real_srv.client()
    kw = dict(model=MODEL_ID, messages=[{"role": "user", "content": "hi"}], max_tokens=16, temperature=0,
              logprobs=True)
    think = {"chat_template_kwargs": {"enable_thinking": False}}
    full = c.chat.completions.create(**kw, extra_body={**think, "ignore_eos": True}).choices[0].logprobs.content
    # the tiny tokenizer: one token per byte (id = byte value), specials by name
    ids = [hf_tiny.SPECIALS[e.token] if e.token in hf_tiny.SPECIALS else e.bytes[0] for e in full]
    stop = ids[3]
    r = c.chat.completions.create(**kw, extra_body={**think, "ignore_eos": ignore_eos, "stop_token_ids": [stop]})
    got, n = r.choices[0].logprobs.content, ids.index(stop) + 1
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == n
    assert [e.bytes for e in got] == [e.bytes for e in full[:n]]            # the stop token has its logprob
    text = b"".join(bytes(e.bytes) for e in full[:n - 1] if e.token not in hf_tiny.SPECIALS)
    assert r.choices[0].message.content == text.decode("utf-8", errors="replace")    # but is not in the text
    bad = real_srv.client().with_options(max_retries=0)
    with pytest.raises(Exception, match="stop_token_ids: token id 999 is outside the vocabulary"):
        bad.chat.completions.create(**kw, extra_body={"stop_token_ids": [999]})


def test_generation_config_repetition_penalty_is_a_default():
    """As vLLM: generation_config.json's repetition_penalty applies where a request leaves it out."""
    from ninfer_rt.server import handlers as H
    from ninfer_rt.server import protocol as P
    defaults = H.sampling_defaults({"temperature": 0.7, "repetition_penalty": 1.05, "top_k": True})
    assert defaults == {"temperature": 0.7, "repetition_penalty": 1.05}
    req = P.parse(P.ChatRequest, dict(CHAT))
    assert H.sampling_params(req, defaults, 4).repetition_penalty == 1.05
    req = P.parse(P.ChatRequest, {**CHAT, "repetition_penalty": 1.0})
    assert H.sampling_params(req, defaults, 4).repetition_penalty == 1.0


def test_generation_config_values_no_request_could_carry_are_dropped(capsys):
    from ninfer_rt.server import handlers as H
    got = H.sampling_defaults({"temperature": -1, "top_k": 20.0, "top_p": "x", "repetition_penalty": 0})
    assert got == {"top_k": 20}
    err = capsys.readouterr().err
    assert "ignoring temperature: expected a finite number >= 0" in err and "ignoring repetition_penalty" in err
