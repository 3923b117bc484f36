"""A completion request's pieces: its prompt, its sampling parameters, its reasoning splitter and echo text
(the replies are replies.py)."""
from __future__ import annotations

import sys
from dataclasses import replace

from ..sampling import SamplingError, SamplingParams
from ..tokenizer import ChatTemplateError, TokenizerError
from . import protocol as P
from . import structured_api as S
from .logprobs_api import requested
from .reasoning import OPEN, ReasoningSplitter, prompt_think_state

SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "seed")
# keyword names the template call itself uses; a client may not override them through chat_template_kwargs
_RESERVED_TEMPLATE_KW = {"messages", "add_generation_prompt", "tools", "bos_token", "eos_token"}


def sampling_defaults(generation_config: dict) -> dict:
    """The model's generation_config.json sampling values, used where a request leaves a field out. A value that
    no request could carry is left out with a stderr line (else every request would be refused for a field it
    never sent); a repetition penalty is named too (it takes requests off the greedy fast paths)."""
    out = {}
    for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
        v = generation_config.get(k)
        if v is None:
            continue
        if k == "top_k" and isinstance(v, float) and v.is_integer():
            v = int(v)
        try:
            SamplingParams(**{k: v})
        except SamplingError as e:
            print(f"ninfer-rt: generation_config.json: ignoring {e}", file=sys.stderr)
            continue
        out[k] = v
    if out.get("repetition_penalty", 1) != 1:
        print(f"ninfer-rt: generation_config.json: repetition_penalty {out['repetition_penalty']} applies to "
              f"requests that leave it out", file=sys.stderr)
    return out


def sampling_params(req: P._Sampling, defaults: dict, max_tokens: int, stop_ids=(), vocab: int | None = None,
                    tok=None) -> SamplingParams:
    """`stop_ids`: the tokenizer's stop ids (e.g. `<|im_end|>`), which the engine's config eos may lack; `vocab`
    bounds the token ids of logit_bias and stop_token_ids; `tok` tokenizes bad_words."""
    kw = {}
    for name in SAMPLING_FIELDS:
        v = getattr(req, name)
        v = defaults.get(name) if v is None else v
        if v is not None:
            kw[name] = v
    stop = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    lp, plp = requested(req, isinstance(req, P.ChatRequest))
    asked = _token_ids("stop_token_ids", req.stop_token_ids or (), vocab)
    try:
        return SamplingParams(max_tokens=max_tokens, min_tokens=req.min_tokens or 0, stop=tuple(stop),
                              ignore_eos=req.ignore_eos,
                              stop_token_ids=tuple(sorted(set(asked) | (set() if req.ignore_eos else set(stop_ids)))),
                              logprobs=lp, prompt_logprobs=plp, logit_bias=_logit_bias(req, vocab),
                              structured=S.structured(req)[0], skip_special_tokens=req.skip_special_tokens,
                              allowed_token_ids=tuple(_token_ids("allowed_token_ids", req.allowed_token_ids or (),
                                                                 vocab)),
                              include_stop_str_in_output=req.include_stop_str_in_output,
                              bad_words_ids=bad_words_ids(tok, req.bad_words or (), vocab), **kw)
    except SamplingError as e:
        msg = str(e)
        if msg.startswith("structured:"):       # name the field the client used
            field = S.structured(req)[1]
            msg = field + msg[len("structured"):]
        raise P.bad_request(msg, param=msg.split(":", 1)[0]) from None


def bad_words_ids(tok, words, vocab: int | None = None) -> tuple[tuple[int, ...], ...]:
    """vLLM's tokenization of bad_words: each word as it would start the text, and with a leading space as it
    would follow another word (that one only where it is as many tokens with another first token)."""
    if words and tok is None:
        raise P.bad_request("bad_words: needs the server's tokenizer", param="bad_words")
    out = []
    for i, w in enumerate(words):
        bare = tok.encode(w.lstrip())
        if not bare:
            raise P.bad_request(f"bad_words.{i}: {w!r} has no tokens", param=f"bad_words.{i}")
        out.append(tuple(_token_ids(f"bad_words.{i}", bare, vocab)))
        spaced = tok.encode(" " + w.lstrip())
        if len(spaced) == len(bare) and spaced[0] != bare[0]:
            out.append(tuple(_token_ids(f"bad_words.{i}", spaced, vocab)))
    return tuple(out)


def truncated(ids: list[int], keep: int, max_context: int, img) -> list[int]:
    """vLLM's truncate_prompt_tokens: the prompt's last `keep` tokens (-1: as many as the context holds)."""
    if img is not None:
        raise P.bad_request("truncate_prompt_tokens: cannot cut a prompt with images (their tokens would be cut "
                            "apart)", param="truncate_prompt_tokens")
    keep = max_context if keep == -1 else keep
    return ids[-keep:]


async def check_grammar(engine, req: P._Sampling, params: SamplingParams) -> None:
    """Compile a structured request's grammar before it is queued (in a worker thread: compiling may take a
    while), so a bad schema or regex is the client's 400 naming its field; the engine's compile is then a cache
    hit."""
    if not params.structured:
        return
    field = S.structured(req)[1]
    grammars = getattr(engine, "grammars", None)
    if grammars is None:
        raise P.bad_request(f"{field}: structured output is not available with this engine", param=field)
    from starlette.concurrency import run_in_threadpool

    from ..grammar import GrammarError
    try:
        await run_in_threadpool(lambda: grammars().compile(params.structured))
    except GrammarError as e:
        field = await run_in_threadpool(lambda: S.blame(req, field, grammars().compile))
        raise P.bad_request(f"{field}: {e}", param=field) from None


def _token_ids(name: str, ids, vocab: int | None) -> list[int]:
    bad = next((t for t in ids if t < 0 or (vocab is not None and t >= vocab)), None)
    if bad is not None:
        raise P.bad_request(f"{name}: token id {bad} is outside the vocabulary [0, {vocab})", param=name)
    return list(ids)


def _logit_bias(req: P._Sampling, vocab: int | None) -> dict:
    """OpenAI's {"token id": bias} -> {id: bias}; keys that are not token ids of this model are the client's 400."""
    out = {}
    for key, bias in (req.logit_bias or {}).items():
        t = int(key) if isinstance(key, str) and key.strip().isdigit() else None
        if t is None or (vocab is not None and t >= vocab):
            raise P.bad_request(f"logit_bias: keys must be token ids in [0, {vocab}), got {key!r}", param="logit_bias")
        out[t] = bias
    return out


def chat_prompt(tok, req: P.ChatRequest, add_generation_prompt: bool = True) -> list[int]:
    extra = dict(req.chat_template_kwargs or {})
    bad = sorted(k for k in extra if not isinstance(k, str) or k in _RESERVED_TEMPLATE_KW)
    if bad:
        raise P.bad_request(f"chat_template_kwargs: {bad[0]!r} cannot be set here", param="chat_template_kwargs")
    cont = req.continue_final_message
    agp = add_generation_prompt and req.add_generation_prompt is not False and not cont
    messages = P.chat_messages(req)
    if cont:
        messages[-1] = _marked_final(req, messages[-1])
    try:
        text = tok.render_chat(messages, add_generation_prompt=agp, tools=P.template_tools(req), **extra)
    except ChatTemplateError as e:     # the artifact's template is broken: the server's fault, not the request's
        raise P.ApiError(500, str(e), type="server_error", code="chat_template_error") from None
    except TokenizerError as e:        # the template's raise_exception refused these messages
        raise P.bad_request(str(e), param="messages") from None
    return tok.encode(_open_final(text, req) if cont else text)


# stands in for the final message's text while the template renders (private-use characters no client text has)
_FINAL_MARK = "\ue000ninfer-final\ue001"


def _marked_final(req: P.ChatRequest, message: dict) -> dict:
    i = len(req.messages) - 1
    if isinstance(message["content"], list):       # image parts: the prompt could not end inside the text
        raise P.bad_request(f"messages.{i}.content: a final message with images cannot be continued",
                            param=f"messages.{i}.content")
    return dict(message, content=_FINAL_MARK)


def _open_final(text: str, req: P.ChatRequest) -> str:
    """vLLM's continue_final_message (Anthropic's prefill): the prompt ends right after the final message's text,
    its end of turn cut, so the model continues that message. The template rendered a mark in its place: what
    it put before the mark is kept, the text follows as the client sent it."""
    i = len(req.messages) - 1
    at = text.find(_FINAL_MARK)
    if at < 0:
        raise P.bad_request(f"messages.{i}: the chat template does not render this message's content, so it "
                            f"cannot be continued", param=f"messages.{i}")
    return text[:at] + P.message_text(req.messages[i])


def completion_prompt(tok, req: P.CompletionRequest, vocab: int) -> list[int]:
    p = req.prompt
    if isinstance(p, list) and isinstance(p[0], (str, list)):
        p = p[0]
    if isinstance(p, str):
        return tok.encode(p)
    bad = next((t for t in p if not 0 <= t < vocab), None)
    if bad is not None:
        raise P.bad_request(f"prompt: token id {bad} is outside the vocabulary [0, {vocab})", param="prompt")
    return list(p)


def prompt_text(tok, req: P.CompletionRequest, ids: list[int]) -> str:
    """What `echo` repeats: the prompt as sent, or the text of a token-id prompt or of a cut one (special tokens
    kept)."""
    p = req.prompt[0] if isinstance(req.prompt, list) and isinstance(req.prompt[0], (str, list)) else req.prompt
    whole = isinstance(p, str) and req.truncate_prompt_tokens is None
    return p if whole else tok.decode(ids, skip_special_tokens=False)


def after_reasoning(tok, prompt_ids: list[int], params: SamplingParams) -> SamplingParams:
    """A chat prompt that leaves a `<think>` block open: the grammar starts after its `</think>` (vLLM's
    structured output with a reasoning parser), so the reasoning stays free text."""
    if not params.structured:
        return params
    start, end = tok.token_to_id("<think>"), tok.token_to_id("</think>")
    if prompt_think_state(prompt_ids, start, end, tok.token_to_id("<|im_start|>")) != OPEN:
        return params
    return replace(params, grammar_after=end)


def splitter(tok, prompt_ids: list[int]) -> ReasoningSplitter:
    start, end = tok.token_to_id("<think>"), tok.token_to_id("</think>")
    return ReasoningSplitter(start, end, prompt_think_state(prompt_ids, start, end, tok.token_to_id("<|im_start|>")))
