"""`logprobs` over the OpenAI API (chat `logprobs` / `top_logprobs`, completions `logprobs` and `echo`), and
`logit_bias`, through the official client against the real Engine with MTP on the tiny fp32 artifact: the objects'
shapes, bytes that spell the text, streamed chunks that add up to the blocking reply, a stop string's cut, an
lm-evaluation-harness style scoring request against HF. The engine's values are checked against HF transformers
in tests/test_logprobs.py."""
from __future__ import annotations

import hf_tiny
import pytest
from test_server import MODEL_ID, real_srv  # noqa: F401

NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}, "ignore_eos": True}


@pytest.fixture(scope="module")
def srv(real_srv):
    return real_srv


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_format_splits_characters_and_skips_specials(chat):
    """The tiny tokenizer has one token per byte: 'é' is two tokens, each `bytes:`; an interrupted character
    reads U+FFFD before the next token; a special token adds no text. Offsets continue across calls."""
    from test_server import tiny_tokenizer

    from ninfer_rt.logprobs import TokenLogprob
    from ninfer_rt.server.logprobs_api import LogprobFormat
    tok = tiny_tokenizer()
    ids = tok.encode("aé") + [0xC3] + tok.encode("*") + [hf_tiny.IM_END_ID] + tok.encode("b")   # text 'aé�*b'
    lps = [TokenLogprob(i, -0.5, ((i, -0.5), (97, -2.0))) for i in ids]
    f = LogprobFormat(tok, chat=chat, top=1)
    got = [f.format(lps[:3]), f.format(lps[3:])]                    # two streamed chunks
    names = ["a", "bytes:\\xc3", "bytes:\\xa9", "bytes:\\xc3", "*", "<|im_end|>", "b"]
    if chat:
        entries = got[0]["content"] + got[1]["content"]
        assert [e["token"] for e in entries] == names and [e["bytes"] for e in entries] == [[i] for i in ids[:5]] + \
            [list(b"<|im_end|>"), [98]]
        assert all(len(e["top_logprobs"]) == 1 and e["top_logprobs"][0]["token"] == e["token"] for e in entries)
    else:
        assert got[0]["tokens"] + got[1]["tokens"] == names
        assert got[0]["text_offset"] + got[1]["text_offset"] == [0, 1, 1, 2, 3, 4, 4]
        assert got[1]["top_logprobs"][0] == {"bytes:\\xc3": -0.5}


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_format_names_tokens_by_id(chat):
    """vLLM's return_tokens_as_token_ids: "token_id:N" names; bytes and text offsets stay the tokens' own."""
    from test_server import tiny_tokenizer

    from ninfer_rt.logprobs import TokenLogprob
    from ninfer_rt.server.logprobs_api import LogprobFormat
    tok = tiny_tokenizer()
    ids = tok.encode("aé") + [hf_tiny.IM_END_ID]
    lps = [TokenLogprob(i, -0.5, ((i, -0.5), (98, -2.0))) for i in ids]
    plain = LogprobFormat(tok, chat=chat, top=2).format(lps)
    got = LogprobFormat(tok, chat=chat, top=2, as_ids=True).format(lps)
    names = [f"token_id:{i}" for i in ids]
    if chat:
        assert [e["token"] for e in got["content"]] == names
        assert [e["bytes"] for e in got["content"]] == [e["bytes"] for e in plain["content"]]
        assert [[t["token"] for t in e["top_logprobs"]] for e in got["content"]] == [[n, "token_id:98"] for n in names]
    else:
        assert got["tokens"] == names and got["text_offset"] == plain["text_offset"]
        assert got["top_logprobs"] == [{n: -0.5, "token_id:98": -2.0} for n in names]


@pytest.mark.parametrize("stream", [False, True], ids=["blocking", "stream"])
def test_return_tokens_as_token_ids_over_the_api(srv, stream):
    body = dict(model=MODEL_ID, messages=[{"role": "user", "content": "hello there"}], max_tokens=6, temperature=0,
                logprobs=True, top_logprobs=2, extra_body={**NO_THINK, "return_tokens_as_token_ids": True})
    c = srv.client()
    if stream:
        entries = [e for ch in c.chat.completions.create(**body, stream=True) if ch.choices and ch.choices[0].logprobs
                   for e in ch.choices[0].logprobs.content]
    else:
        entries = c.chat.completions.create(**body).choices[0].logprobs.content
    assert len(entries) == 6
    for e in entries:
        assert e.token.startswith("token_id:") and e.top_logprobs[0].token == e.token
        assert _token_text(bytes(e.bytes)) == _token_text(srv.state.tokenizer.token_bytes(int(e.token[9:])))


def test_chat_logprobs_spell_the_content(srv):
    r = srv.client().chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": "hello there"}], max_tokens=16, temperature=0,
        logprobs=True, top_logprobs=3, extra_body=NO_THINK)
    ch = r.choices[0]
    entries = ch.logprobs.content
    assert len(entries) == r.usage.completion_tokens == 16
    for e in entries:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        assert [t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs), reverse=True)
        assert (e.top_logprobs[0].token, e.top_logprobs[0].logprob) == (e.token, e.logprob)   # greedy: the argmax
        assert e.token == _token_text(bytes(e.bytes))
    text = b"".join(bytes(e.bytes) for e in entries if e.token not in hf_tiny.SPECIALS)
    assert text.decode("utf-8", errors="replace") == ch.message.content


def _token_text(b: bytes) -> str:
    """A token's text: its bytes when they are whole UTF-8 characters, else OpenAI's `bytes:\\xNN` form."""
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{x:02x}" for x in b)


def test_chat_without_logprobs_has_none(srv):
    r = srv.client().chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": "hi"}], max_tokens=3, extra_body=NO_THINK)
    assert r.choices[0].logprobs is None


def _completion(srv, stream: bool, **kw):
    """-> (text, finish_reason, usage or None, tokens, token_logprobs, top_logprobs, text_offset)."""
    c = srv.client()
    args = dict(model=MODEL_ID, prompt="The quick brown fox", max_tokens=12, temperature=0, logprobs=2,
                extra_body={"ignore_eos": True}, **kw)
    if not stream:
        r = c.completions.create(**args)
        lp = r.choices[0].logprobs
        return (r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens, lp.tokens,
                lp.token_logprobs, lp.top_logprobs, lp.text_offset)
    text, finish, lists = "", None, ([], [], [], [])
    for ch in c.completions.create(stream=True, **args):
        (choice,) = ch.choices
        text += choice.text
        finish = choice.finish_reason or finish
        if choice.logprobs is not None:
            lp = choice.logprobs
            for acc, part in zip(lists, (lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset)):
                acc += part
    return (text, finish, None, *lists)


def test_completion_stream_adds_up_to_the_blocking_reply(srv):
    text, finish, n, tokens, lps, tops, offsets = _completion(srv, False)
    assert finish == "length" and len(tokens) == len(lps) == len(tops) == len(offsets) == n == 12
    assert offsets == sorted(offsets) and offsets[-1] <= len(text)
    for t, lp, top, o in zip(tokens, lps, tops, offsets):
        assert lp <= 0 and top[t] == lp and 1 <= len(top) <= 3       # the top 2 and the chosen token
        if not t.startswith("bytes:") and t not in hf_tiny.SPECIALS:
            assert text[o:o + len(t)] == t                           # whole characters: where the text has them
    assert _completion(srv, True)[:2] + _completion(srv, True)[3:] == (text, finish, tokens, lps, tops, offsets)


def test_stop_string_cuts_the_logprobs_too(srv):
    full = _completion(srv, False)[0]
    stop = next(ch for ch in full[3:] if ch != "\ufffd" and not ch.isspace())
    for stream in (False, True):
        text, finish, n, tokens, *_ = _completion(srv, stream, stop=[stop])
        assert (text, finish) == (full[:full.index(stop)], "stop")
        # the tokens up to the one that completed the stop string, as many as usage counts
        assert 0 < len(tokens) <= 12 and (n is None or len(tokens) == n)


@pytest.mark.parametrize("stream", [False, True], ids=["blocking", "stream"])
def test_echo_repeats_the_prompt(srv, stream):
    full = _completion(srv, False, echo=True)
    plain = _completion(srv, False)
    got = _completion(srv, stream, echo=True)
    prompt = "The quick brown fox"
    assert full[0] == got[0] == prompt + plain[0]
    n = len(_tok().encode(prompt))
    assert got[3] == full[3] and len(full[3]) == n + 12 and full[3][n:] == plain[3]    # tokens
    assert full[4][0] is None and full[5][0] is None and got[4][1:] == full[4][1:]    # nothing predicts token 0
    assert full[6] == got[6] and full[6][n:] == [o + len(prompt) for o in plain[6]]    # offsets continue


def _tok():
    from test_server import tiny_tokenizer
    return tiny_tokenizer()


def test_echo_logprobs_score_a_prompt_like_lm_eval(srv, tmp_path_factory):
    """lm-evaluation-harness scores a continuation with echo=True, logprobs=1, max_tokens=1 on token ids: the
    prompt tokens' logprobs equal HF transformers' log_softmax over the same ids."""
    import torch

    from test_server import _ARTIFACT
    ids = _tok().encode("def add(a, b):\n    return a + b\n")
    r = srv.client().completions.create(model=MODEL_ID, prompt=[ids], max_tokens=1, temperature=0, logprobs=1,
                                        echo=True, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == len(ids) + 1 and lp.token_logprobs[0] is None
    ref = hf_tiny.load_hf_reference(_ARTIFACT["hf"]).causal_lm()
    with torch.no_grad():
        want = torch.log_softmax(ref(input_ids=torch.tensor([ids])).logits[0].double(), -1)
    got = torch.tensor(lp.token_logprobs[1:len(ids)], dtype=torch.float64)
    assert (got - want[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]).abs().max() < 1e-4
    for top, v in zip(lp.top_logprobs[1:len(ids)], lp.token_logprobs[1:]):
        assert max(top.values()) >= v          # the chosen token and the most likely one (lm-eval's is_greedy)


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_logit_bias_forces_a_token(srv, chat):
    """{"65": 100} (byte 'A' of the tiny tokenizer) wins every greedy choice; the logprobs stay the model's."""
    c = srv.client()
    kw = dict(model=MODEL_ID, max_tokens=5, temperature=0, logit_bias={"65": 100})
    if chat:
        r = c.chat.completions.create(messages=[{"role": "user", "content": "hi"}], logprobs=True,
                                      extra_body=NO_THINK, **kw)
        text, lps = r.choices[0].message.content, [e.logprob for e in r.choices[0].logprobs.content]
    else:
        r = c.completions.create(prompt="hi", logprobs=0, extra_body={"ignore_eos": True}, **kw)
        text, lps = r.choices[0].text, r.choices[0].logprobs.token_logprobs
    assert text == "AAAAA" and len(lps) == 5 and all(v < -0.01 for v in lps)     # 'A' is no likely token here


def test_format_drops_padded_vocabulary_rows():
    """A model's vocabulary may be padded past the tokenizer's: such rows are no token, so no alternative."""
    from test_server import tiny_tokenizer

    from ninfer_rt.logprobs import TokenLogprob
    from ninfer_rt.server.logprobs_api import LogprobFormat
    t = TokenLogprob(97, -0.1, ((97, -0.1), (300, -0.2)))
    chat = LogprobFormat(tiny_tokenizer(), chat=True, top=2).format([t])
    assert [e["token"] for e in chat["content"][0]["top_logprobs"]] == ["a"]
    assert LogprobFormat(tiny_tokenizer(), chat=False, top=2).format([t])["top_logprobs"] == [{"a": -0.1}]


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_vllm_prompt_logprobs_are_hf_log_softmax_with_ranks(srv, chat):
    """vLLM's prompt_logprobs=k: None for the first prompt token, then {id: {logprob, rank, decoded_token}} for the
    prompt token (its rank among the vocabulary) and the k likeliest; values are HF's log_softmax."""
    import torch

    from test_server import _ARTIFACT, _post
    tok = _tok()
    if chat:
        body = {"messages": [{"role": "user", "content": "def add(a, b):"}], **NO_THINK}
        r = _post(srv, "/v1/chat/completions", {"model": MODEL_ID, "max_tokens": 1, "prompt_logprobs": 2, **body})
        ids = _post(srv, "/tokenize", {"model": MODEL_ID, "messages": body["messages"],
                                       "chat_template_kwargs": NO_THINK["chat_template_kwargs"]}).json()["tokens"]
        got = r.json()["prompt_logprobs"]
    else:
        ids = tok.encode("def add(a, b):\n    return a + b\n")
        r = _post(srv, "/v1/completions", {"model": MODEL_ID, "prompt": ids, "max_tokens": 1, "prompt_logprobs": 2,
                                           "ignore_eos": True})
        got = r.json()["choices"][0]["prompt_logprobs"]
    assert r.status_code == 200 and len(got) == len(ids) and got[0] is None, r.json()
    ref = hf_tiny.load_hf_reference(_ARTIFACT["hf"]).causal_lm()
    with torch.no_grad():
        want = torch.log_softmax(ref(input_ids=torch.tensor([ids])).logits[0].double(), -1)
    for j, (entry, t) in enumerate(zip(got[1:], ids[1:])):
        row = want[j]
        mine = entry[str(t)]
        assert abs(mine["logprob"] - float(row[t])) < 1e-4
        lo, hi = 1 + int((row > row[t] + 1e-5).sum()), int((row >= row[t] - 1e-5).sum())    # vLLM's: ties count
        assert lo <= mine["rank"] <= hi
        assert sorted(e["rank"] for e in entry.values())[:2] == [1, 2] and len(entry) in (2, 3)
        assert mine["decoded_token"] == tok.decode([t]) and next(iter(entry)) == str(t)     # vLLM's: own first


def test_prompt_logprobs_refuse_streams(srv):
    from test_server import _post
    r = _post(srv, "/v1/completions", {"model": MODEL_ID, "prompt": "x", "prompt_logprobs": 1, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
