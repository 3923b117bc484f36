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
