"""Tensor-parallel partition of every artifact tensor, as a table (qwen38-architecture.md §13).

Each rule maps a name pattern to the split dim and the *segments* along it: a segment is `count` units of
`unit` rows/columns each (e.g. Q heads of 2*head_dim rows). Every segment is cut into `tp` equal contiguous
runs of whole units, and rank r takes run r of every segment, in order. That one mechanism gives: q_proj by
Q head keeping each [q|gate] block whole; in_proj_qkv / conv1d as three ranges (q, k by key head, v by
value head); o_proj / out_proj / down_proj by input columns; gate/up and lm_head by rows.

Replicated: embeddings, norms, mtp.fc (a 2H->H matrix used once per draft token; replicating it saves an
all-reduce), and the whole vision tower (`visual.*`: simplest for the runtime, which runs it on one rank;
~0.46 B params at 27B, so every rank pays ~0.9 GB bf16 -- pack with `--no-vision` to avoid it).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from ninfer_formats.constants import FORMATS
from ninfer_formats.errors import SourceError

# a segment: (count field, unit field or None for 1, unit multiplier)
_Q_HEADS = ("num_attention_heads", "head_dim", 2)
_KV_HEADS = ("num_key_value_heads", "head_dim", 1)
_O_COLS = ("num_attention_heads", "head_dim", 1)
_K_HEADS = ("linear_num_key_heads", "linear_key_head_dim", 1)
_V_HEADS = ("linear_num_value_heads", "linear_value_head_dim", 1)
_V_SCALAR = ("linear_num_value_heads", None, 1)
_FFN = ("intermediate_size", None, 1)
_VOCAB = ("vocab_size", None, 1)

_L = r"(?:mtp\.)?layers\.\d+\."
_GDN = r"layers\.\d+\.linear_attn\."

RULES: tuple[tuple[str, int | None, tuple], ...] = (
    (_L + r"self_attn\.q_proj\.weight", 0, (_Q_HEADS,)),
    (_L + r"self_attn\.[kv]_proj\.weight", 0, (_KV_HEADS,)),
    (_L + r"self_attn\.o_proj\.weight", 1, (_O_COLS,)),
    (_GDN + r"in_proj_qkv\.weight", 0, (_K_HEADS, _K_HEADS, _V_HEADS)),
    (_GDN + r"conv1d\.weight", 0, (_K_HEADS, _K_HEADS, _V_HEADS)),
    (_GDN + r"in_proj_z\.weight", 0, (_V_HEADS,)),
    (_GDN + r"in_proj_[ab]\.weight", 0, (_V_SCALAR,)),
    (_GDN + r"(?:A_log|dt_bias)", 0, (_V_SCALAR,)),
    (_GDN + r"out_proj\.weight", 1, (_V_HEADS,)),
    (_L + r"mlp\.(?:gate|up)_proj\.weight", 0, (_FFN,)),
    (_L + r"mlp\.down_proj\.weight", 1, (_FFN,)),
    (r"lm_head\.weight", 0, (_VOCAB,)),
    # replicated
    (r"embed_tokens\.weight", None, ()),
    (r"norm\.weight", None, ()),
    (_L + r"(?:input_layernorm|post_attention_layernorm)\.weight", None, ()),
    (_L + r"self_attn\.[qk]_norm\.weight", None, ()),
    (_GDN + r"norm\.weight", None, ()),
    (r"mtp\.(?:fc|pre_fc_norm_embedding|pre_fc_norm_hidden|norm)\.weight", None, ()),
    (r"visual\..+", None, ()),
)
_COMPILED = tuple((re.compile(p), dim, segs) for p, dim, segs in RULES)


@dataclass(frozen=True)
class Split:
    """How one tensor is cut: `ranges[r]` are rank r's (start, stop) runs along `dim` (None: whole copy)."""

    dim: int | None
    ranges: tuple[tuple[tuple[int, int], ...], ...]
    rank_shape: tuple[int, ...]

    @property
    def replicated(self) -> bool:
        return self.dim is None


def rule_for(name: str) -> tuple[int | None, tuple]:
    for rx, dim, segs in _COMPILED:
        if rx.fullmatch(name):
            return dim, segs
    raise SourceError(f"{name}: no tensor-parallel rule covers this tensor")


def _segment_runs(name: str, cfg, segs: tuple, tp: int) -> tuple[list[list[tuple[int, int]]], int]:
    runs: list[list[tuple[int, int]]] = [[] for _ in range(tp)]
    off = 0
    for count_field, unit_field, mult in segs:
        count = getattr(cfg, count_field)
        unit = (getattr(cfg, unit_field) if unit_field else 1) * mult
        if count % tp:
            raise SourceError(f"{name}: cannot split {count_field}={count} over --tp {tp} "
                              f"(not divisible)")
        per = count // tp * unit
        for r in range(tp):
            runs[r].append((off + r * per, off + (r + 1) * per))
        off += count * unit
    return runs, off


def _check_cuts(name: str, fmt: str, runs, width: int) -> None:
    block = FORMATS[fmt].k_multiple
    for rank_runs in runs:
        for a, b in rank_runs:
            if a % block or b % block:
                raise SourceError(f"{name}: --tp cut at column {a if a % block else b} of {width} is not on a "
                                  f"{block}-column {fmt} block boundary (pick another --tp or "
                                  f"--override this tensor's role)")


def plan_split(name: str, shape: tuple[int, ...], cfg, tp: int, fmt: str) -> Split:
    """The cut of tensor `name` (artifact shape `shape`, stored as `fmt`) over `tp` ranks; SourceError if illegal."""
    dim, segs = rule_for(name)
    if dim is None or tp == 1:
        return Split(None, tuple(() for _ in range(tp)), tuple(shape))
    runs, total = _segment_runs(name, cfg, segs, tp)
    if total != shape[dim]:
        raise SourceError(f"{name}: dim {dim} has {shape[dim]} entries, the partition table expects {total}")
    if dim == len(shape) - 1:
        if any(len(r) != 1 for r in runs):
            raise SourceError(f"{name}: a column split must give each rank one contiguous run")
        _check_cuts(name, fmt, runs, shape[dim])
    size = sum(b - a for a, b in runs[0])
    rank_shape = tuple(size if i == dim else d for i, d in enumerate(shape))
    return Split(dim, tuple(tuple(r) for r in runs), rank_shape)
