"""Byte-level BPE tokenizer of the tiny model, trained on the train split of the local stdlib.

Layout (Qwen-style): ids 0..V-6 are BPE tokens (256 byte symbols + merges), the 5 special tokens take the
LAST ids in Qwen's order: <|endoftext|> V-5, <|im_start|> V-4, <|im_end|> V-3, <think> V-2, </think> V-1
(V = 4096: 4091..4095). NFC normalizer, Qwen3.5 pre-tokenizer regex + ByteLevel (no regex), ByteLevel
decoder, no BOS. Training is deterministic: same files + same vocab size -> byte-identical tokenizer.json.

CLI: `python3 tools/tiny_tokenizer.py --out ninfer_pack/tiny [--vocab 4096] [--max-files N] [--json]`
writes tokenizer.json, tokenizer_config.json and chat_template.jinja.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny_data  # noqa: E402

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")
VOCAB_SIZE = 4096
# Qwen3.5's split pattern (adds \p{M} to Qwen2's): letters with marks, single digits, punctuation runs,
# newline runs, and whitespace that leaves one space to the next word.
PRETOKENIZE_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"""
                     r"""| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
# Minimal Qwen-style ChatML; string or OpenAI-style list-of-parts content; no default system prompt.
CHAT_TEMPLATE = (
    "{%- for message in messages %}\n"
    "{%- if message['content'] is string %}{%- set content = message['content'] %}\n"
    "{%- else %}{%- set content = namespace(t='') %}"
    "{%- for part in message['content'] %}{%- if part['type'] == 'text' %}"
    "{%- set content.t = content.t + part['text'] %}{%- endif %}{%- endfor %}"
    "{%- set content = content.t %}{%- endif %}\n"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>' + '\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "{{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n")
FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


class TokenizerError(ValueError):
    """A tokenizer cannot be built or does not have the documented layout."""


def special_ids(vocab_size: int = VOCAB_SIZE) -> dict[str, int]:
    return {s: vocab_size - len(SPECIALS) + i for i, s in enumerate(SPECIALS)}


def _skeleton() -> Tokenizer:
    tok = Tokenizer(models.BPE(byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok


def train(texts, vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """BPE on `texts` (an iterable of str), then the specials appended at the top ids."""
    n_bpe = vocab_size - len(SPECIALS)
    tok = _skeleton()
    trainer = trainers.BpeTrainer(vocab_size=n_bpe, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator(texts, trainer)
    if tok.get_vocab_size() != n_bpe:
        raise TokenizerError(f"BPE training produced {tok.get_vocab_size()} tokens, wanted {n_bpe} "
                             "(corpus too small for this vocab size)")
    tok.add_special_tokens(list(SPECIALS))
    check(tok, "trained tokenizer")
    return tok


def check(tok: Tokenizer, where: str) -> dict[str, int]:
    """Raise unless the specials sit at the documented ids; returns {token: id}."""
    want = special_ids(tok.get_vocab_size())
    for s, i in want.items():
        if tok.token_to_id(s) != i:
            raise TokenizerError(f"{where}: special token {s!r} has id {tok.token_to_id(s)}, expected {i}")
    return want


def load(folder) -> Tokenizer:
    path = Path(folder) / "tokenizer.json"
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises its own Exception type for bad JSON
        raise TokenizerError(f"{path}: cannot load tokenizer ({str(e).splitlines()[0]})") from None
    check(tok, str(path))
    return tok


def tokenizer_config(vocab_size: int) -> dict:
    ids = special_ids(vocab_size)
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 8192,
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None,
        "add_bos_token": False, "add_eos_token": False,
        "clean_up_tokenization_spaces": False, "split_special_tokens": False, "errors": "replace",
        "added_tokens_decoder": {str(i): {"content": s, "lstrip": False, "normalized": False, "rstrip": False,
                                          "single_word": False, "special": True} for s, i in ids.items()},
    }


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def write_files(tok: Tokenizer, out) -> list[Path]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    texts = {"tokenizer.json": tok.to_str(pretty=True) + "\n",
             "tokenizer_config.json": json.dumps(tokenizer_config(tok.get_vocab_size()), indent=2) + "\n",
             "chat_template.jinja": CHAT_TEMPLATE}
    for name in FILES:
        _write(out / name, texts[name])
    return [out / n for n in FILES]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--vocab", type=int, default=VOCAB_SIZE)
    ap.add_argument("--max-files", type=int, default=None)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    try:
        corpus = tiny_data.collect(max_files=a.max_files)
        tok = train((t for _, t in corpus.train), a.vocab)
        paths = write_files(tok, a.out)
    except (tiny_data.DataError, TokenizerError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    res = {"files": [str(p) for p in paths], "python_version": corpus.python_version,
           "corpus_hash": corpus.corpus_hash, "train_files": len(corpus.train),
           "tokenizer_sha256": hashlib.sha256(paths[0].read_bytes()).hexdigest()}
    print(json.dumps(res) if a.json else "\n".join(f"{k}: {v}" for k, v in res.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
