"""Compile the GEMV kernels for a GPU target without a GPU (CPU CI), and inspect what they became.

`compile_kernel(fn, signature, constexprs, cc)` is `triton.compile(ASTSource(...), target=GPUTarget("cuda",
cc, 32))` with the divisibility-by-16 hints the JIT would give 16-aligned pointers and sizes. It needs the
real backend: kernels decorated while TRITON_INTERPRET=1 are interpreter objects and cannot be compiled, so
tests run `python -m ninfer_kernels.compile_check` in a subprocess with the variable removed.

CLI: `python -m ninfer_kernels.compile_check [--cc 70 90] [--json] [--sass NAME]` compiles every variant in
`variants()` and prints one line each (registers, spills, shared memory, SASS instruction count).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

_BASE_SIG = {"out_ptr": None, "res_ptr": None, "ws_ptr": "*fp32", "cnt_ptr": "*i32", "fscale": "fp32",
             "T": "i32", "N": "i32", "G": "i32", "split": "i32", "stride_xt": "i32", "stride_ot": "i32",
             "stride_rt": "i32"}
_DIVISIBLE = ("x_ptr", "out_ptr", "res_ptr", "ws_ptr", "cnt_ptr", "G", "stride_xt", "stride_ot", "stride_rt")
_TORCH_TO_TRITON = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}


def compile_kernel(fn, signature: dict, constexprs: dict, cc: int, *, divisible=(), num_warps: int = 4,
                   num_stages: int = 2):
    """CompiledKernel for CUDA compute capability `cc` (e.g. 70, 90); raises on a compile error."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if not hasattr(fn, "arg_names"):
        raise RuntimeError("compile_kernel needs a @triton.jit function; TRITON_INTERPRET=1 was set at import")
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in divisible if a in fn.arg_names}
    src = ASTSource(fn, signature, constexprs, attrs)
    return triton.compile(src, target=GPUTarget("cuda", cc, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


@dataclass(frozen=True)
class Variant:
    """One kernel instantiation: format module name, activation dtype, launch constants."""
    fmt: str
    x_dtype: str = "float16"
    t_tile: int = 1
    block_n: int = 64
    block_g: int = 16
    use_split: bool = False
    use_dot: bool = False
    has_res: bool = False
    num_warps: int = 4

    @property
    def name(self) -> str:
        return (f"{self.fmt}-{self.x_dtype}-T{self.t_tile}-n{self.block_n}-g{self.block_g}"
                f"{'-split' if self.use_split else ''}{'-dot' if self.use_dot else ''}{'-res' if self.has_res else ''}")


def _module(fmt: str):
    import importlib
    return importlib.import_module(f"ninfer_kernels.gemv_{fmt}")


def compile_variant(v: Variant, cc: int):
    mod = _module(v.fmt.split(":")[0])
    kernel, wsig = mod.kernel_for(v.fmt)
    xt = _TORCH_TO_TRITON[v.x_dtype]
    sig = {"x_ptr": f"*{xt}", **wsig, **{k: (val or f"*{xt}") for k, val in _BASE_SIG.items()}}
    dot_kind = {"float16": 0, "bfloat16": 1}.get(v.x_dtype, 2)
    const = {"T_TILE": v.t_tile, "BLOCK_N": v.block_n, "BLOCK_G": v.block_g, "USE_SPLIT": v.use_split,
             "USE_DOT": v.use_dot, "DOT_KIND": dot_kind, "HAS_RES": v.has_res, "EVEN_G": True}
    for k in const:
        sig[k] = "constexpr"
    div = _DIVISIBLE + tuple(wsig)
    return compile_kernel(kernel, sig, const, cc, divisible=div, num_warps=v.num_warps)


def variants(ccs=(70, 90)) -> list[tuple[Variant, int]]:
    """Every kernel and path the dispatcher can launch, per target (fp16 on sm_70, bf16 on sm_90)."""
    fmts = ("nvfp4", "q6_k", "iq3_s", "f8", "plain:bf16", "plain:f16", "plain:f32")
    out = []
    for cc in ccs:
        xd = "float16" if cc < 80 else "bfloat16"
        for f in fmts:
            bg = 32 if f.startswith("plain") else 16
            out.append((Variant(f, xd, 1, block_g=bg), cc))
            out.append((Variant(f, xd, 4, block_g=bg, use_split=True, has_res=True), cc))
            out.append((Variant(f, xd, 16, block_g=bg // 2, use_dot=True, use_split=True), cc))
    return out


def _cuda_tool(name: str, compiled, *args) -> str:
    import triton
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        r = subprocess.run([tool, *args, f.name], capture_output=True, text=True)
    return r.stdout if r.returncode == 0 else ""


def sass(compiled) -> str:
    """SASS listing of a compiled kernel ("" where the bundled disassembler dropped the arch, e.g. sm_70)."""
    return _cuda_tool("cuobjdump", compiled, "-sass")


def summarize(compiled) -> dict:
    """Registers, local (spill) bytes, shared bytes from the cubin; SASS instruction count where available."""
    usage = _cuda_tool("cuobjdump", compiled, "-res-usage")
    fields = dict(tok.split(":", 1) for line in usage.splitlines() if "REG:" in line for tok in line.split())
    n_instr = len(re.findall(r"^\s*/\*[0-9a-f]{4,}\*/\s+\S", sass(compiled), flags=re.M))
    return {"regs": int(fields.get("REG", -1)), "local": int(fields.get("LOCAL", -1)),
            "shared": int(fields.get("SHARED", -1)), "sass_instr": n_instr}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cc", type=int, nargs="+", default=[70, 90])
    ap.add_argument("--json", action="store_true", help="one JSON list on stdout")
    ap.add_argument("--only", default="", help="substring filter on variant names")
    ap.add_argument("--sass", default="", help="print the SASS of the first variant whose name contains this")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("error: unset TRITON_INTERPRET to compile for a GPU target", file=sys.stderr)
        return 2
    rows, failed = [], 0
    for v, cc in variants(tuple(args.cc)):
        if args.only not in v.name:
            continue
        t0 = time.time()
        try:
            c = compile_variant(v, cc)
            row = {"variant": v.name, "cc": cc, "ok": True, "seconds": round(time.time() - t0, 2), **summarize(c)}
            if args.sass and args.sass in v.name:
                print(sass(c))
                return 0
        except Exception as e:  # report every failing variant, not only the first
            failed += 1
            row = {"variant": v.name, "cc": cc, "ok": False, "error": f"{type(e).__name__}: {e}".splitlines()[0]}
        rows.append(row)
        if not args.json:
            print(" ".join(f"{k}={val}" for k, val in row.items()), file=sys.stderr if not row["ok"] else sys.stdout)
    if args.json:
        print(json.dumps(rows))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
