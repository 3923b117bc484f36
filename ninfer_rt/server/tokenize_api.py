"""`POST /tokenize` and `POST /detokenize`, as vLLM's server has them: a prompt (or chat messages through the
artifact's template) to token ids, and token ids back to text. Neither touches the engine."""
from __future__ import annotations

from . import handlers as H
from . import protocol as P


class TokenizeRequest(P._Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[P.ChatMessage] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict | None = None
    tools: list[P.Tool] | None = None          # rendered by the template, as in a chat request
    continue_final_message: bool = False


class DetokenizeRequest(P._Strict):
    model: str | None = None
    tokens: list[int]


def tokenize(tok, data, served: tuple[str, ...], max_model_len: int) -> dict:
    req = P.parse(TokenizeRequest, data)
    P.check_model(req.model, served)
    if (req.prompt is None) == (req.messages is None):
        raise P.bad_request("body: expected exactly one of 'prompt' and 'messages'")
    if req.prompt is not None:
        ids = tok.encode(req.prompt)
    else:
        if req.continue_final_message and "add_generation_prompt" in data and req.add_generation_prompt:
            raise P.bad_request("continue_final_message: cannot be combined with add_generation_prompt true",
                                param="continue_final_message")
        chat = P.ChatRequest(messages=req.messages, chat_template_kwargs=req.chat_template_kwargs, tools=req.tools,
                             continue_final_message=req.continue_final_message)
        P.check_chat(chat)
        for i, m in enumerate(chat.messages):      # the count would leave out the image's expanded tokens
            for j, part in enumerate(m.content if isinstance(m.content, list) else ()):
                if part.type in P.IMAGE_PART_TYPES:
                    raise P.bad_request(f"messages.{i}.content.{j}: image parts are not supported by /tokenize",
                                        param=f"messages.{i}.content.{j}")
        ids = H.chat_prompt(tok, chat, add_generation_prompt=req.add_generation_prompt)
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids}


def detokenize(tok, data, served: tuple[str, ...]) -> dict:
    req = P.parse(DetokenizeRequest, data)
    P.check_model(req.model, served)
    vocab = tok.vocab_size              # the tokenizer's: a model's padded rows are no token
    bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise P.bad_request(f"tokens: token id {bad} is outside the vocabulary [0, {vocab})", param="tokens")
    return {"prompt": tok.decode(req.tokens, skip_special_tokens=False)}
