"""Training data for the tiny model: the running interpreter's standard library (*.py), split by file.

The split is a pure function of the file's path relative to the stdlib root (sha256 of the path), so the
same file is held out on every machine and every Python version; only the set of files differs (the
report records the Python version and a hash of the file list + contents).

CLI (stats only): `python3 tools/tiny_data.py [--max-files N] [--json]`.
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import json
import sys
import sysconfig
import tokenize
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

EXCLUDED_PARTS = frozenset({"site-packages", "dist-packages", "__pycache__"})
HELDOUT_PER_10000 = 200                 # ~2 % of files
SPLIT_RULE = "heldout iff int.from_bytes(sha256(relpath)[:8], 'little') % 10000 < 200"
CHAT_MAX_PER_FILE = 6
CHAT_LINES = (3, 40)                    # top-level defs of this many lines become chat examples
_QUESTIONS = ("Write the {kind} `{name}` from the module `{module}`.",
              "Show me the source of `{module}.{name}`.",
              "How is `{name}` implemented in `{module}`?",
              "Give the Python code for the {kind} `{name}` ({module}).")


class DataError(ValueError):
    """The corpus cannot be built (message names the path and what is wrong)."""


@dataclass(frozen=True)
class Corpus:
    root: str
    python_version: str
    train: tuple[tuple[str, str], ...]      # (relative path, text)
    heldout: tuple[tuple[str, str], ...]
    skipped: tuple[str, ...]                # unreadable / undecodable files
    corpus_hash: str                        # paths + contents of the files used

    @property
    def file_list_hash(self) -> str:
        rels = sorted(r for r, _ in self.train + self.heldout)
        return hashlib.sha256("\n".join(rels).encode()).hexdigest()

    def __post_init__(self):
        if not self.train or not self.heldout:
            raise DataError(f"{self.root}: split left {len(self.train)} train / {len(self.heldout)} "
                            "held-out files; need both non-empty")


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def list_sources(root: Path) -> list[str]:
    """Sorted POSIX paths (relative to root) of *.py files, third-party folders excluded."""
    rels = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root)
        if not EXCLUDED_PARTS & set(rel.parts) and p.is_file():
            rels.append(rel.as_posix())
    return sorted(rels)


def split_of(rel: str) -> str:
    h = int.from_bytes(hashlib.sha256(rel.encode("utf-8")).digest()[:8], "little")
    return "heldout" if h % 10000 < HELDOUT_PER_10000 else "train"


def read_source(path: Path) -> str | None:
    """Text per the file's coding cookie; None for files Python itself could not read."""
    try:
        with tokenize.open(path) as f:
            return f.read()
    except (OSError, SyntaxError, UnicodeDecodeError, LookupError):
        return None


def corpus_hash(items) -> str:
    h = hashlib.sha256()
    for rel, text in sorted(items):
        h.update(rel.encode() + b"\0" + hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest())
    return h.hexdigest()


def collect(root: Path | None = None, max_files: int | None = None) -> Corpus:
    """Read and split the stdlib. `max_files` keeps the first N train and N//10+1 held-out files (smoke runs)."""
    root = Path(root) if root is not None else stdlib_root()
    if not root.is_dir():
        raise DataError(f"{root}: stdlib folder not found")
    parts = {"train": [], "heldout": []}
    skipped = []
    for rel in list_sources(root):
        part = parts[split_of(rel)]
        if max_files is not None and len(part) >= (max_files if part is parts["train"] else max_files // 10 + 1):
            continue
        text = read_source(root / rel)
        if text is None or not text.strip():
            skipped.append(rel)
        else:
            part.append((rel, text))
    return Corpus(str(root), sys.version.split()[0], tuple(parts["train"]), tuple(parts["heldout"]),
                  tuple(skipped), corpus_hash(parts["train"] + parts["heldout"]))


def module_name(rel: str) -> str:
    mod = rel[:-3].replace("/", ".")
    return mod[: -len(".__init__")] if mod.endswith(".__init__") else mod


def chat_examples(rel: str, text: str) -> list[list[dict]]:
    """Short top-level functions/classes as ChatML conversations (user asks, assistant answers with code)."""
    try:
        with warnings.catch_warnings():       # 3.12+ warns about invalid escapes in old test files
            warnings.simplefilter("ignore")
            tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    lines = text.splitlines()
    out = []
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        start = min([node.lineno] + [d.lineno for d in node.decorator_list])
        if not CHAT_LINES[0] <= node.end_lineno - start + 1 <= CHAT_LINES[1]:
            continue
        code = "\n".join(lines[start - 1: node.end_lineno])
        kind = "class" if isinstance(node, ast.ClassDef) else "function"
        pick = hashlib.sha256(f"{rel}:{node.name}".encode()).digest()
        q = _QUESTIONS[pick[0] % len(_QUESTIONS)].format(kind=kind, name=node.name, module=module_name(rel))
        conv = [{"role": "user", "content": q}, {"role": "assistant", "content": code}]
        if pick[1] % 4 == 0:
            conv.insert(0, {"role": "system", "content": "You are a concise Python expert."})
        out.append(conv)
        if len(out) == CHAT_MAX_PER_FILE:
            break
    return out


@contextmanager
def _plain_specials(tok):
    """Special-token strings inside source text stay plain text (never control tokens)."""
    saved, tok.encode_special_tokens = tok.encode_special_tokens, True
    try:
        yield tok
    finally:
        tok.encode_special_tokens = saved


def encode_documents(tok, texts, specials: dict[str, int]) -> list[np.ndarray]:
    """Raw files: text tokens + <|endoftext|>."""
    with _plain_specials(tok):
        encs = tok.encode_batch_fast(list(texts))
    eot = specials["<|endoftext|>"]
    return [np.asarray(e.ids + [eot], dtype=np.int32) for e in encs]


def encode_chats(tok, convs, specials: dict[str, int]) -> list[np.ndarray]:
    """ChatML ids exactly as chat_template.jinja renders them, then <|endoftext|>."""
    pieces = [f"{m['role']}\n{m['content']}" for conv in convs for m in conv]
    with _plain_specials(tok):
        ids = iter([e.ids for e in tok.encode_batch_fast(pieces)])
        nl = tok.encode("\n").ids
    out = []
    for conv in convs:
        seq = []
        for _ in conv:
            seq += [specials["<|im_start|>"]] + next(ids) + [specials["<|im_end|>"]] + nl
        out.append(np.asarray(seq + [specials["<|endoftext|>"]], dtype=np.int32))
    return out


def token_streams(tok, corpus: Corpus, specials: dict[str, int], seed: int = 0):
    """(train ids, held-out ids) as flat int32 arrays; train documents (files + chats) in a seeded order."""
    docs = encode_documents(tok, [t for _, t in corpus.train], specials)
    convs = [c for rel, text in corpus.train for c in chat_examples(rel, text)]
    docs += encode_chats(tok, convs, specials)
    order = np.random.default_rng(seed).permutation(len(docs))
    train = np.concatenate([docs[i] for i in order])
    heldout = np.concatenate(encode_documents(tok, [t for _, t in corpus.heldout], specials))
    return train, heldout, len(convs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=None, help="stdlib folder (default: this interpreter's)")
    ap.add_argument("--max-files", type=int, default=None)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    try:
        c = collect(a.root, a.max_files)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    stats = {"root": c.root, "python_version": c.python_version, "train_files": len(c.train),
             "heldout_files": len(c.heldout), "skipped": len(c.skipped), "corpus_hash": c.corpus_hash,
             "train_bytes": sum(len(t) for _, t in c.train), "heldout_bytes": sum(len(t) for _, t in c.heldout)}
    print(json.dumps(stats) if a.json else "\n".join(f"{k}: {v}" for k, v in stats.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
