"""Token-level reasoning split (`<think>` ... `</think>`): independent of how tokens are chunked, and
holding partial UTF-8 back across the close tag."""
from __future__ import annotations

import hf_tiny
import pytest
from test_server import tiny_tokenizer


S, E = hf_tiny.SPECIALS["<think>"], hf_tiny.SPECIALS["</think>"]
A, B = list(b"ab"), list(b"cd")

SPLITS = [
    # (prompt tail, generated ids, expected (reasoning, content))
    ("open", [S, 10], A + [E] + B, ("ab", "cd")),
    ("open-never-closed", [S, 10], A + B, ("abcd", "")),
    ("closed", [S, 10, 10, E, 10, 10], A + B, ("", "abcd")),
    ("closed-later-tags-are-content", [S, E], A + [S] + B + [E], ("", "abcd")),
    ("no-tags-model-opens", [10], [S] + A + [E] + B, ("ab", "cd")),
    ("no-tags-late-open-is-content", [10], A + [S] + B, ("", "abcd")),
]


@pytest.mark.parametrize("prompt,gen,want", [s[1:] for s in SPLITS], ids=[s[0] for s in SPLITS])
@pytest.mark.parametrize("chunk", [1, 2, 100], ids=["tok-by-tok", "pairs", "whole"])
def test_reasoning_split_is_chunking_independent(prompt, gen, want, chunk):
    from ninfer_rt.server.reasoning import OutputText, ReasoningSplitter, prompt_think_state
    tok = tiny_tokenizer()
    text = OutputText(tok, (), ReasoningSplitter(S, E, prompt_think_state(prompt, S, E)))
    r = c = ""
    for i in range(0, len(gen), chunk):
        dr, dc = text.push(gen[i:i + chunk])
        r, c = r + dr, c + dc
    fr, fc = text.flush()
    assert (r + fr, c + fc) == want


def test_reasoning_holds_partial_utf8_across_the_close_tag():
    from ninfer_rt.server.reasoning import OPEN, OutputText, ReasoningSplitter
    tok = tiny_tokenizer()
    euro = list("€".encode())                     # 3 bytes = 3 tokens in the byte-level tiny vocab
    text = OutputText(tok, ("cd",), ReasoningSplitter(S, E, OPEN))
    assert text.push(euro[:2]) == ("", "")         # incomplete character: held back
    assert text.push(euro[2:] + [E] + list(b"xcdy")) == ("€", "x")
    assert text.stopped and text.flush() == ("", "")


T = hf_tiny.SPECIALS["<|im_start|>"]
TURNS = [
    # (prompt ids, expected state): only the ids after the last turn header count
    ("earlier-turn-open-tag", [T, 10, S, 10, T, 10], "none"),
    ("earlier-turn-closed-then-open", [T, 10, S, 10, E, T, 10, S, 10], "open"),
    ("generation-turn-closed", [T, 10, S, T, 10, S, 10, E, 10], "closed"),
    ("no-turn-header", [10, S, 10], "open"),
]


@pytest.mark.parametrize("prompt,want", [t[1:] for t in TURNS], ids=[t[0] for t in TURNS])
def test_think_state_reads_the_generation_turn_only(prompt, want):
    from ninfer_rt.server.reasoning import prompt_think_state
    assert prompt_think_state(prompt, S, E, T) == want


def _shipped_tokenizer():
    """ninfer-tiny's tokenizer: its chat template leaves `<think>` to the model (no tag in the generation
    prompt), the case where tags inside messages could be mistaken for the turn's own."""
    from pathlib import Path

    from ninfer_rt.tokenizer import Tokenizer
    d = Path(__file__).resolve().parents[1] / "ninfer_pack" / "tiny"
    res = {f: (d / f).read_text() for f in ("tokenizer.json", "chat_template.jinja", "tokenizer_config.json")}
    return Tokenizer.from_resources(res, eos_token_ids=[])


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": "What does the <think> tag do in HTML?"}],
    [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "<think>"},
     {"role": "user", "content": "and?"}],
    [{"role": "user", "content": "What do <think> and </think> mean?"}],
    [{"role": "user", "content": "plain"}],
], ids=["user-open-tag", "history-open-tag", "user-both-tags", "no-tags"])
def test_tags_in_messages_do_not_change_the_split(messages):
    """The model's `<think>ab</think>cd` splits the same whatever the messages say about the tags."""
    from ninfer_rt.server import handlers as H
    from ninfer_rt.server import protocol as P
    from ninfer_rt.server.reasoning import OutputText
    tok = _shipped_tokenizer()
    ids = H.chat_prompt(tok, P.ChatRequest(messages=messages))
    text = OutputText(tok, (), H.splitter(tok, ids))
    gen = [tok.token_to_id("<think>")] + tok.encode("ab") + [tok.token_to_id("</think>")] + tok.encode("cd")
    r, c = text.push(gen)
    fr, fc = text.flush()
    assert (r + fr, c + fc) == ("ab", "cd")
