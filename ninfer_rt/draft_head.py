"""The MTP draft head: which rows of which weight turn the MTP output into draft logits.

The MTP module owns no head (reference §11): by default its logits come from the main `lm_head`, which in every
shipped recipe is Q6_K (6.56 bits per weight). A draft step reads all of it for one token, 1.04 GB at 27B TP1:
about 0.31 ms of a ~0.72 ms draft step on the H200 (bench/NOTES.md §32, §37). Drafts only propose tokens; the
target's verify step, which keeps the full lm_head, decides what is emitted, for greedy and for rejection
sampling alike (a draft distribution that is zero outside some rows is still a distribution). So a cheaper draft
head can only cost acceptance, never change the output distribution.

`NINFER_DRAFT_HEAD` (read when the model is built):
  auto       (default) nvfp4 where the lm_head's K is a multiple of 16 (every Qwen3.8 size), else lm_head.
             Measured on the H200 at 27B (bench/NOTES.md §38): the draft step 0.565 -> 0.448 ms, the modelled
             K = 3 MTP rate +5.4 % at acceptance 0.75; ninfer-tiny's acceptance was the same within 1 %;
  lm_head    the main lm_head;
  nvfp4      an NVFP4 copy of this rank's lm_head rows, made at load (4.5 bits per weight: 0.72 GB at 27B TP1);
  nvfp4:N    the same for the token ids below N only (0.38 GB for N = 131072); the other ids get -inf logits
             and are never drafted. Byte-level BPE vocabularies (Qwen's included) number their tokens in merge
             order, so low ids are the frequent ones: NInfer's Qwen3.6 artifacts carry a 131,072-row draft-head
             shortlist for the same reason (reference anchors §3).
The copy is quantized on the weight's device with the NVFP4 codec's rules (`nvfp4_quantize`, the same bytes
as `ninfer_formats.codecs.nvfp4.quantize`), from the lm_head dequantized a slab of rows at a time.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ninfer_formats.constants import E2M1_MAX, E4M3_MAX, E4M3_MIN_SUBNORMAL, NVFP4_BLOCK
from ninfer_formats.errors import LoadError

from .weights import QWeight, dequantize

ENV = "NINFER_DRAFT_HEAD"
SLAB_ROWS = 8192          # lm_head rows dequantized at once (8192 x 5120 fp32 = 168 MB)
# E2M1 rounding boundaries (magnitude index = how many are passed); ties round up where the upper code is even
_BOUNDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


@dataclass(frozen=True)
class DraftHeadSpec:
    kind: str = "lm_head"            # "lm_head" | "nvfp4" | "auto" (resolved against the lm_head by `resolve`)
    vocab_limit: int | None = None   # nvfp4:N -> N (token ids below it)

    def __str__(self) -> str:
        return self.kind if self.vocab_limit is None else f"{self.kind}:{self.vocab_limit}"

    @staticmethod
    def parse(text: str, what: str = ENV) -> "DraftHeadSpec":
        """`auto`, `lm_head`, `nvfp4` or `nvfp4:N` (N a positive integer); anything else is a one-line error
        naming `what` (the variable, or the CLI flag that set it)."""
        kind, _, n = text.strip().partition(":")
        if kind in ("lm_head", "auto", "nvfp4") and not _:
            return DraftHeadSpec(kind)
        if kind == "nvfp4" and n.isdigit() and int(n) > 0:
            return DraftHeadSpec("nvfp4", int(n))
        raise LoadError(f"{what}={text!r}: expected auto, lm_head, nvfp4 or nvfp4:N with N a positive integer")


DEFAULT = "auto"


def spec_from_env() -> DraftHeadSpec:
    return DraftHeadSpec.parse(os.environ.get(ENV, DEFAULT))


def resolve(spec: DraftHeadSpec, lm_head: QWeight) -> DraftHeadSpec:
    """`auto` -> nvfp4 when the lm_head's rows split into NVFP4 blocks, else lm_head; other specs as they are
    (an explicit nvfp4 on an lm_head that does not split is `build`'s error)."""
    if spec.kind != "auto":
        return spec
    return DraftHeadSpec("nvfp4" if lm_head.shape[1] % NVFP4_BLOCK == 0 else "lm_head")


def use(text: str | None, what: str = "--draft-head") -> None:
    """A CLI's choice: checked here, then handed to every model this process and the TP ranks it spawns build
    (through the environment, which they inherit). None leaves the environment as it is."""
    if text is not None:
        DraftHeadSpec.parse(text, what)
        os.environ[ENV] = text.strip()


def _e2m1_codes(q: torch.Tensor) -> torch.Tensor:
    a = q.abs()
    mag = torch.zeros(q.shape, dtype=torch.uint8, device=q.device)
    for bound, tie_up in _BOUNDS:
        mag += (a >= bound) if tie_up else (a > bound)
    return mag | (q < 0).to(torch.uint8) << 3


def nvfp4_scale(w: torch.Tensor) -> float:
    """The per-tensor second-level scale of fp32 `w` (the codec's `global_scale`: amax / (6 * 448), 1.0 when
    that is not a normal float32)."""
    s2 = (w.abs().max() if w.numel() else torch.zeros((), device=w.device)).float() / (E2M1_MAX * E4M3_MAX)
    s2 = float(s2)
    return s2 if s2 >= torch.finfo(torch.float32).tiny else 1.0


def nvfp4_quantize(w: torch.Tensor, s2: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [N, K] (K a multiple of 16) -> (codes u8 [N, K/2], E4M3 scales u8 [N, K/16]) on w's device, by the
    codec's rules: block scale amax / (6 s2) (1.0 where 0) clamped to [2**-9, 448] and rounded to E4M3, codes
    of w / (scale * s2) rounded to E2M1 (ties to the even code), the even element in the low nibble."""
    n, k = w.shape
    s2t = torch.tensor(s2, dtype=torch.float32, device=w.device)
    blocks = w.float().reshape(n, k // NVFP4_BLOCK, NVFP4_BLOCK)
    sb = blocks.abs().amax(-1) / (E2M1_MAX * s2t)
    sb = torch.where(sb == 0, torch.ones_like(sb), sb).clamp(E4M3_MIN_SUBNORMAL, E4M3_MAX)
    f8 = sb.to(torch.float8_e4m3fn)
    q = blocks / (f8.float() * s2t)[..., None]
    codes = _e2m1_codes(q).reshape(n, k)
    return codes[:, 0::2] | (codes[:, 1::2] << 4), f8.view(torch.uint8)


def _dense_rows(lm_head: QWeight, a: int, b: int) -> torch.Tensor:
    """fp32 rows [a, b) of the lm_head on its device: the Triton dequantizer on CUDA, the numpy codecs elsewhere."""
    part = lm_head.rows(a, b)
    if part.device.type == "cuda" and part.quantized:
        from ninfer_kernels.dispatch import dense_weight
        return dense_weight(part, torch.float32)
    return dequantize(part)


def local_rows(spec: DraftHeadSpec, vocab_lo: int, rows: int) -> int:
    """How many of this rank's lm_head rows (token ids vocab_lo .. vocab_lo + rows - 1) the draft head keeps."""
    if spec.vocab_limit is None:
        return rows
    return max(0, min(rows, spec.vocab_limit - vocab_lo))


def build(spec: DraftHeadSpec, lm_head: QWeight, vocab_lo: int) -> QWeight | None:
    """The draft head's NVFP4 weight over this rank's first `local_rows` lm_head rows (None: the spec keeps
    the lm_head, or this rank keeps no row). K must be a multiple of 16 (every Qwen3.8 hidden size is)."""
    if spec.kind == "lm_head":
        return None
    n, k = lm_head.shape
    keep = local_rows(spec, vocab_lo, n)
    if keep == 0:
        return None
    if k % NVFP4_BLOCK:
        raise LoadError(f"{ENV}: the lm_head's K = {k} is not a multiple of {NVFP4_BLOCK}")
    amax = 0.0
    for a in range(0, keep, SLAB_ROWS):        # two passes: the global scale needs every kept row's amax
        amax = max(amax, float(_dense_rows(lm_head, a, min(keep, a + SLAB_ROWS)).abs().max()))
    s2 = nvfp4_scale(torch.tensor([amax]))
    codes = torch.empty(keep, k // 2, dtype=torch.uint8, device=lm_head.device)
    scales = torch.empty(keep, k // NVFP4_BLOCK, dtype=torch.uint8, device=lm_head.device)
    for a in range(0, keep, SLAB_ROWS):
        b = min(keep, a + SLAB_ROWS)
        codes[a:b], scales[a:b] = nvfp4_quantize(_dense_rows(lm_head, a, b), s2)
    return QWeight("nvfp4", (keep, k), {"codes": codes, "scales": scales, "gscale": s2}, "mtp.draft_head")


def logits(ops, x: torch.Tensor, head: QWeight, rows: int) -> torch.Tensor:
    """Draft logits [n, rows] of this rank's vocab slice from `head` (its first head.shape[0] rows); the rows
    past them are -inf, so no argmax and no sampler picks them."""
    out = ops.linear(x, head)
    if out.shape[-1] == rows:
        return out
    pad = torch.full((x.shape[0], rows - out.shape[-1]), float("-inf"), dtype=out.dtype, device=out.device)
    return torch.cat([out, pad], dim=-1)
