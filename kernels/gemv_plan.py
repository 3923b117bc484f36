"""A resolved GEMV launch for one weight at one T: the decode step's per-call host path.

The first call of a (weight, T, dtype, epilogue) goes through the checked path (`gemv_launch.gemv`: argument
validation, packed-word views, the tuner, the split-K workspace); once its config is final it leaves a
`GemvPlan` in the weight's plan dict. Later calls only check what can change between calls (the activation,
out and residual tensors), allocate the output when none is given, and launch.

Launch: Triton's `kernel[grid](...)` re-binds and re-specializes ~25 arguments per call (tens of us of Python
on a slow host). The plan keeps the `CompiledKernel` the first launch returned and calls its launcher
directly, with the argument list `JITFunction.run` would build (every parameter in order, constexprs
included; the same in Triton 3.6 and 3.9). The compiled binary is specialized on 16-byte alignment of the
pointers, the pointee dtypes and the values of the integer arguments (== 1, divisible by 16), so the plan records those
properties of the first call and uses the direct launcher only when a call matches them; any other call takes
`kernel[grid]`, which picks or compiles the right binary. NINFER_GEMV_FAST_LAUNCH=0 disables the direct path.
"""
from __future__ import annotations

import os

import torch

from .gemv_glu import EPI_RES, epi_of, xp_follows_y

_FIXED = ("x_ptr", "out_ptr", "res_ptr", "ws_ptr", "cnt_ptr", "fscale", "T", "N", "G", "split", "stride_xt",
          "stride_ot", "stride_rt")


def _spec(x, out, res) -> tuple:
    """What the compiled binary was specialized on among the per-call arguments."""
    return (x.data_ptr() % 16 == 0, out.data_ptr() % 16 == 0, res.data_ptr() % 16 == 0,
            x.stride(0), out.stride(0), res.stride(0), res.dtype)


class GemvPlan:
    """launch(x, out, residual) -> out, or None when the call does not fit the plan (caller takes the checked
    path, which raises the proper error or builds another plan)."""

    __slots__ = ("K", "N", "T", "cnt", "consts", "device", "dtype", "epi", "grid", "kernel", "out_dtype", "runner",
                 "scalars", "spec", "tail", "weights", "ws")

    def __init__(self, kernel, grid, weights, ws, cnt, scalars, consts: dict, compiled, x, out, res, epi: int):
        """res: the tensor the first launch passed as res_ptr; epi: its `gemv_glu.EPI_*` mode."""
        self.kernel, self.grid, self.weights, self.ws, self.cnt = kernel, grid, tuple(weights), ws, cnt
        self.scalars, self.consts = tuple(scalars), dict(consts)   # (fscale, T, N, G, split)
        self.T, self.N, self.K = x.shape[0], out.shape[1], x.shape[1]
        # x's and out's dtypes differ for prepared activations (int32 words in, bf16 out: kernels/x16.py)
        self.dtype, self.out_dtype, self.device, self.epi = x.dtype, out.dtype, x.device, int(epi)
        self.runner, self.spec, self.tail = None, _spec(x, out, res), ()
        jit = getattr(kernel, "jit", kernel)
        names = list(getattr(jit, "arg_names", ()))
        allc = {k: v for k, v in {**consts, **getattr(kernel, "extra_consts", {})}.items()
                if k not in ("num_warps", "num_stages", "launch_pdl")}   # launch options, not parameters
        head = len(_FIXED) + len(self.weights)
        if compiled is not None and hasattr(compiled, "packed_metadata") and len(names) == head + len(allc) \
                and set(names[head:]) == set(allc) and os.environ.get("NINFER_GEMV_FAST_LAUNCH", "1") != "0":
            self.tail = tuple(allc[n] for n in names[head:])
            self.runner = compiled[grid]

    def __call__(self, x, out, residual):
        xs = x.stride()
        if x.dtype != self.dtype or xs[1] != 1 or x.shape[0] != self.T or x.device != self.device \
                or epi_of(residual) != self.epi:
            return None
        T, N = self.T, self.N
        if out is None:
            out = torch.empty((T, N), dtype=self.out_dtype, device=self.device)
            os_ = (N, 1)
        else:
            os_ = out.stride()
            if out.shape != (T, N) or out.dtype != self.out_dtype or os_[1] != 1 or out.device != self.device:
                return None
        if residual is None:
            res, rs = out, os_
        elif self.epi == EPI_RES:
            res, rs = residual, residual.stride()
            if residual.shape != (T, N) or rs[1] != 1 or residual.device != self.device:
                return None
        else:
            res = residual.y     # the SwiGLU outputs: the checked path's check_glu, cheaply
            rs = res.stride()
            if res.shape != (T, N // 2) or rs != (N // 2, 1) or res.dtype != self.out_dtype \
                    or res.device != self.device or not xp_follows_y(residual):
                return None
        ws = out if self.ws is None else self.ws
        cnt = out if self.cnt is None else self.cnt
        if self.runner is not None and (x.data_ptr() % 16 == 0, out.data_ptr() % 16 == 0,
                                        res.data_ptr() % 16 == 0, xs[0], os_[0], rs[0], res.dtype) == self.spec:
            self.runner(x, *self.weights, out, res, ws, cnt, *self.scalars, xs[0], os_[0], rs[0], *self.tail)
        else:
            self.kernel[self.grid](x, *self.weights, out, res, ws, cnt, *self.scalars, xs[0], os_[0], rs[0],
                                   **self.consts)
        return out
