"""A GEMV launch configuration (`GemvConfig`, frozen and checked on creation) and the device facts the tile
choice reads (SM count, whether Triton interprets)."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@dataclass(frozen=True)
class GemvConfig:
    block_n: int
    block_g: int
    num_warps: int = 4
    num_stages: int = 2     # pipeline depth of the weight loads (tl.dot and elementwise; 1 = none)
    split: int = 1          # K splits (1 = none); clamped to the number of K tiles
    use_dot: bool = False   # tensor-core / tl.dot inner product instead of FMAs + sums
    t_tile: int = 0         # T columns per CTA; 0 = next power of two of T (>= 16 with use_dot)
    h2: bool = False        # the format's packed-half2 variant (NVFP4, Q6_K; T <= 8: gemv_*_h2)
    mma: bool = False       # the format's warp-MMA variant (NVFP4, Q6_K; sm_80+, T <= 16: gemv_*_mma); block_g is
                            # 8 or 16 groups per step and block_n a multiple of 16 rows per warp

    def __post_init__(self):
        for f in ("block_n", "block_g", "num_warps", "num_stages", "split"):
            v = getattr(self, f)
            if v < 1 or (f in ("block_n", "block_g", "num_warps") and v & (v - 1)):
                raise ValueError(f"GemvConfig.{f} must be a positive power of two (split: positive), got {v}")
        if self.t_tile and (self.t_tile & (self.t_tile - 1) or (self.use_dot and self.t_tile < 16)):
            raise ValueError(f"GemvConfig.t_tile must be a power of two (>= 16 with use_dot), got {self.t_tile}")
        if self.h2 + self.use_dot + self.mma > 1:
            raise ValueError("GemvConfig: h2, use_dot and mma are three different inner products; pick one")
        if self.mma and (self.block_g not in (8, 16) or self.block_n % (16 * self.num_warps)
                         or self.t_tile not in (0, 8, 16) or self.num_stages > 3):
            raise ValueError("GemvConfig: mma needs block_g 8 or 16, block_n a multiple of 16 * num_warps, t_tile "
                             f"0, 8 or 16 and num_stages 1, 2 or 3, got {self.block_g}, {self.block_n}, {self.t_tile}, "
                             f"{self.num_stages}")


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 8
    return torch.cuda.get_device_properties(device).multi_processor_count
