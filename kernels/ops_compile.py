"""Compile every decode-path (non-GEMV) kernel for sm_70 (fp16) and sm_90 (bf16, fp16) without a GPU.

Each kernel module exposes `compile_specs(act) -> [(kernel, signature, constexprs[, num_warps])]` with the
launch constants its launcher uses at the real model's sizes (head_dim 256, hidden 5120, dk = dv = 128).
Compilation goes through `ninfer_kernels.compile_check.compile_kernel` (triton.compile + GPUTarget); run it
with TRITON_INTERPRET unset (interpreted kernels cannot be compiled).

CLI: `python -m ninfer_kernels.ops_compile [--cc 70 90] [--json] [--only NAME]` prints one line per variant
(registers, LOCAL and STACK bytes, ptxas' spill-store bytes, shared memory).
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import sys
import time

MODULES = ("rmsnorm", "rmsnorm_gates", "rope", "attention_decode", "kv_write", "silu_mul", "gated_rmsnorm",
           "gdn_conv", "gdn_gates", "gdn_ba_gates", "gdn_recurrent", "gdn_conv_recurrent", "sampling", "topk_select",
           "x16")
# V100 users run fp16 activations (no bf16 arithmetic there); the H200 runs bf16, and fp16 for the kernels
# whose code differs by more than the casts (tl.dot operand types)
ACTS = {70: ("fp16",), 90: ("bf16", "fp16")}
FP16_ON_90 = ("attention_decode",)


def variants(ccs=(70, 90)):
    """-> [(name, cc, kernel, signature, constexprs, num_warps)]."""
    from .pdl import compile_const
    out = []
    for cc in ccs:
        for act in ACTS.get(cc, ("fp16",)):
            for mod_name in MODULES:
                if cc >= 80 and act == "fp16" and mod_name not in FP16_ON_90:
                    continue
                mod = importlib.import_module(f"ninfer_kernels.{mod_name}")
                takes_cc = "cc" in inspect.signature(mod.compile_specs).parameters   # target-dependent tiles
                for i, spec in enumerate(mod.compile_specs(act, cc=cc) if takes_cc else mod.compile_specs(act)):
                    fn, sig, const = spec[:3]
                    warps = spec[3] if len(spec) > 3 else 4
                    if "PDL" in fn.arg_names and "PDL" not in const:   # griddepcontrol: sm_90 PTX (pdl.py)
                        const = {**const, "PDL": compile_const(cc)}
                    if "PRELOAD" in fn.arg_names and "PRELOAD" not in const:   # as launched with PDL on
                        const = {**const, "PRELOAD": const["PDL"]}
                    name = f"{mod_name}.{fn.__name__}#{i}-{act}"
                    out.append((name, cc, fn, sig, const, warps))
    return out


def compile_one(fn, sig, const, cc, warps):
    from .compile_check import compile_kernel
    full = {**sig, **{k: "constexpr" for k in const}}
    # at the real sizes the JIT sees 16-aligned pointers and multiple-of-16 sizes/strides and specialises on
    # them (vectorised loads); compile that variant
    aligned = tuple(k for k, v in sig.items() if v.startswith("*") or v in ("i32", "i64"))
    return compile_kernel(fn, full, const, cc, divisible=aligned, num_warps=warps)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cc", type=int, nargs="+", default=[70, 90])
    ap.add_argument("--json", action="store_true", help="one JSON list on stdout")
    ap.add_argument("--only", default="", help="substring filter on variant names")
    ap.add_argument("--no-summary", action="store_true", help="compile only (skip cuobjdump register counts)")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("error: unset TRITON_INTERPRET to compile for a GPU target", file=sys.stderr)
        return 2
    from .compile_check import summarize
    from .pdl import ptx_order_ok
    rows, failed = [], 0
    for name, cc, fn, sig, const, warps in variants(tuple(args.cc)):
        if args.only not in name:
            continue
        t0 = time.time()
        try:
            c = compile_one(fn, sig, const, cc, warps)
            row = {"variant": name, "cc": cc, "ok": True, "seconds": round(time.time() - t0, 2),
                   "pdl_ok": ptx_order_ok(c.asm["ptx"], const.get("PDL", 0), preload=const.get("PRELOAD", 0),
                                          late_trigger=bool(const.get("LATE", 0))),
                   **({} if args.no_summary else summarize(c))}
        except Exception as e:  # report every failing variant, not only the first
            failed += 1
            row = {"variant": name, "cc": cc, "ok": False, "error": f"{type(e).__name__}: {e}".splitlines()[0]}
        rows.append(row)
        if not args.json:
            print(" ".join(f"{k}={v}" for k, v in row.items()), file=sys.stdout if row["ok"] else sys.stderr)
    if args.json:
        print(json.dumps(rows))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
