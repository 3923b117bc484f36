"""Torch references for the linear kernels: decode with the numpy codecs, then one fp32 matmul.

The packed formats are decoded by `ninfer_formats.codecs` itself (`nvfp4.dequantize`, `dequantize`,
`decode`) -- the same functions the packer's round-trip tests trust -- never by a copy of the decode rules.
Inputs are the kernels' inputs (torch tensors, any device); the result is on x's device in x's dtype:
  y = (x.float() @ W.T + residual.float()).to(x.dtype)
`rows` (optional int array) restricts the reference to those output features (checking huge shapes on a
GPU without decoding all of W on the CPU); the result then has len(rows) columns.
"""
from __future__ import annotations

import numpy as np
import torch

from ninfer_formats import codecs


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().contiguous().numpy()


def _take(t: torch.Tensor, rows) -> torch.Tensor:
    return t if rows is None else t[torch.as_tensor(rows, dtype=torch.long, device=t.device)]


def _finish(x: torch.Tensor, w: np.ndarray, residual, rows) -> torch.Tensor:
    wt = torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)).to(x.device)
    y = x.float() @ wt.T
    if residual is not None:
        y = y + _take(residual.T, rows).T.float()
    return y.to(x.dtype)


def dense_nvfp4(codes, scales, gscale, rows=None) -> np.ndarray:
    return codecs.nvfp4.dequantize(_np(_take(codes, rows)), _np(_take(scales, rows)), np.float32(gscale))


def dense_ggml(fmt: str, blocks, K: int, rows=None) -> np.ndarray:
    b = _np(_take(blocks, rows))
    return codecs.dequantize(fmt, b, (b.shape[0], K))


def dense_f8(codes, row_scale, rows=None) -> np.ndarray:
    c, s = _np(_take(codes, rows)), _np(_take(row_scale, rows)).astype(np.float32)
    return codecs.decode("f8_e4m3_row", codecs.fp8.join(s, c), c.shape)


def dense_plain(w, rows=None) -> np.ndarray:
    return _np(_take(w, rows).float())


def ref_nvfp4(x, codes, scales, gscale, residual=None, rows=None):
    return _finish(x, dense_nvfp4(codes, scales, gscale, rows), residual, rows)


def ref_q6_k(x, blocks, residual=None, rows=None):
    return _finish(x, dense_ggml("q6_k", blocks, x.shape[-1], rows), residual, rows)


def ref_iq3_s(x, blocks, residual=None, rows=None):
    return _finish(x, dense_ggml("iq3_s", blocks, x.shape[-1], rows), residual, rows)


def ref_f8(x, codes, row_scale, residual=None, rows=None):
    return _finish(x, dense_f8(codes, row_scale, rows), residual, rows)


def ref_plain(x, w, residual=None, rows=None):
    return _finish(x, dense_plain(w, rows), residual, rows)


def ref_linear(x, fmt: str, data, residual=None, rows=None):
    """Reference for `dispatch.linear` given a QWeight's fmt and the QWeight (its blocks rebuilt if the triton
    backend released them after repacking) or its data dict."""
    data = data.full_data() if hasattr(data, "full_data") else data
    if fmt == "nvfp4":
        return ref_nvfp4(x, data["codes"], data["scales"], data["gscale"], residual, rows)
    if fmt in ("q6_k", "iq3_s"):
        return _finish(x, dense_ggml(fmt, data["blocks"], x.shape[-1], rows), residual, rows)
    if fmt == "f8_e4m3_row":
        return ref_f8(x, data["codes"], data["row_scale"], residual, rows)
    return ref_plain(x, data["w"], residual, rows)
