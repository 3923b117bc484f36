"""Known-pattern checks of an all-reduce implementation, run at startup before it carries model traffic.

Every rank can compute every rank's contribution, so each rank checks the complete reduced result itself:
rank 0's check proves rank 1's data reached it and rank 1's proves the other direction. Pattern kinds:
- "ramp": small integers that depend on rank and position, x_r[i] = (i * (2r + 3) + 5r + 1) mod 16. Sums over
  up to 8 ranks stay <= 120, exact in bf16/fp16/fp32 in any order, and a rank counted twice or dropped, a peer
  read at a shifted offset or a peer slot read from the wrong rank all change them.
- "blocks": 64-element blocks, each owned by one rank (the others contribute 0): a result holding only the
  local or only the peer data, or a message reduced only up to some point, shows as wrong blocks.
- "round" (2 ranks only): seeded random values spread over 13 binades; the result must be the exact sum of
  the two partials rounded once to nearest-even in their dtype, bit for bit (the reference numerics: fp32 sum
  of the bf16 partials, one rounding). Truncation, double rounding or a low-precision accumulator show here.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

KINDS = ("ramp", "blocks", "round")
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
BLOCK = 64
HIDDEN = 5120            # the decode message of the 27B model: one hidden row


@dataclass(frozen=True)
class Case:
    kind: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    seed: int = 0

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"all-reduce check: kind {self.kind!r} is not one of {KINDS}")
        if not self.shape or any(not isinstance(d, int) or d <= 0 for d in self.shape):
            raise ValueError(f"all-reduce check: shape {self.shape!r} must be positive integers")
        if self.dtype not in DTYPES:
            raise ValueError(f"all-reduce check: dtype {self.dtype} is not one of {DTYPES}")

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()

    @property
    def label(self) -> str:
        return f"{self.kind} {str(self.dtype).removeprefix('torch.')}{list(self.shape)}"


def contribution(case: Case, rank: int, world: int) -> torch.Tensor:
    """Rank `rank`'s partial (CPU tensor of case.dtype and case.shape)."""
    i = torch.arange(case.numel, dtype=torch.int64)
    if case.kind == "ramp":
        v = torch.remainder(i * (2 * rank + 3) + 5 * rank + 1, 16).float()
    elif case.kind == "blocks":
        own = torch.remainder(i // BLOCK, world) == rank
        v = torch.where(own, (rank + 1) * 16 + torch.remainder(i, 8), 0).float()
    else:
        if world != 2:
            raise ValueError("all-reduce check: 'round' cases are defined for 2 ranks only")
        g = torch.Generator().manual_seed(case.seed * 1009 + rank)
        mag = torch.pow(2.0, torch.randint(-6, 7, (case.numel,), generator=g).float())
        v = torch.randn(case.numel, generator=g) * mag
    return v.to(case.dtype).reshape(case.shape)


def expected(case: Case, world: int) -> torch.Tensor:
    """The exact reduced result. Integer kinds are exact in any order. For 'round', the sum of two partials in
    fp64 is exact and one rounding to the dtype follows (for bf16/fp16 via fp32, which for two half-precision
    addends gives the same value as rounding the exact sum once)."""
    parts = [contribution(case, r, world) for r in range(world)]
    if case.kind != "round":
        return sum(p.float() for p in parts).to(case.dtype)
    exact = parts[0].double() + parts[1].double()
    return exact.float().to(case.dtype) if case.dtype != torch.float32 else exact.float()


def mismatch(case: Case, got: torch.Tensor, want: torch.Tensor) -> str | None:
    """None when `got` equals `want` exactly (NaN never equals); else what is wrong, naming the first element."""
    if tuple(got.shape) != tuple(want.shape):
        return f"shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    if got.dtype != want.dtype:
        return f"dtype {got.dtype}, expected {want.dtype}"
    bad = (got.float() != want.float()).flatten().nonzero()
    if len(bad):
        i = int(bad[0])
        return (f"{len(bad)} of {want.numel()} elements wrong; first at {i}: got {got.flatten()[i].item()!r}, "
                f"expected {want.flatten()[i].item()!r}")
    return None


def run_cases(reduce_fn, cases, rank: int, world: int, device, wait=None) -> str | None:
    """Reduce every case's partial with `reduce_fn` (issue all, then `wait()`, then compare): the first failure
    as a one-line message, or None. Inputs are copied to the device before the first reduction, so no host
    copy can block behind a reduction that never completes (`wait` is where a hang is detected)."""
    xs = [contribution(c, rank, world).to(device) for c in cases]
    outs = [reduce_fn(x) for x in xs]
    if wait is not None:
        wait()
    for c, y in zip(cases, outs):
        msg = mismatch(c, y.detach().cpu(), expected(c, world))
        if msg:
            return f"{c.label}: {msg}"
    return None


def default_cases(world: int, max_bytes: int) -> list[Case]:
    """Decode-sized and odd-sized messages in both wire dtypes, the largest message that fits `max_bytes`,
    and (2 ranks) the rounding cases."""
    h, bf, f32 = HIDDEN, torch.bfloat16, torch.float32
    cases = [Case("ramp", (8,), bf), Case("ramp", (h,), bf), Case("blocks", (3, h), bf),
             Case("ramp", (8,), f32), Case("ramp", (h,), f32), Case("blocks", (2, h), f32),
             Case("blocks", (24, 40), bf)]
    if world == 2:
        cases += [Case("round", (h,), bf, 1), Case("round", (4, h), bf, 2), Case("round", (h,), f32, 3),
                  Case("round", (h,), torch.float16, 4)]
    if max_bytes >= 16:
        cases += [Case("ramp", (max_bytes // 2,), bf), Case("blocks", (max_bytes // 4,), f32)]
    return cases


def variant(case: Case) -> Case:
    """Different contents of the same shape and dtype (a graph replay must read the new inputs)."""
    if case.kind == "round":
        return replace(case, seed=case.seed + 7)
    return replace(case, kind="blocks" if case.kind == "ramp" else "ramp")
