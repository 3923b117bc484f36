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
    """One kernel instantiation: format ("nvfp4", "q6_k", "iq3_s", "f8", "plain:bf16|f16|f32"), activation
    dtype, launch constants; dequant=True is the format's dequantizer (prefill path on sm_70)."""
    fmt: str
    x_dtype: str = "float16"
    t_tile: int = 1
    block_n: int = 64
    block_g: int = 16
    use_split: bool = False
    use_dot: bool = False
    epi: int = 0              # gemv_glu.EPI_*: 1 residual add, 2 SwiGLU, 3 SwiGLU + prepared copy
    num_warps: int = 4
    dequant: bool = False
    stages: int = 1           # elementwise weight-load pipeline depth (STAGES)
    xpre: bool = False        # prepared activations (ninfer_kernels.x16): x_ptr is int32 words

    @property
    def name(self) -> str:
        if self.dequant:
            return f"{self.fmt}-dequant-{self.x_dtype}-n{self.block_n}-g{self.block_g}"
        return (f"{self.fmt}-{self.x_dtype}-T{self.t_tile}-n{self.block_n}-g{self.block_g}-w{self.num_warps}"
                f"{f'-s{self.stages}' if self.stages > 1 else ''}{'-split' if self.use_split else ''}{'-dot' if self.use_dot else ''}{('', '-res', '-glu', '-gluxp')[self.epi]}"
                f"{'-xpre' if self.xpre else ''}")


def _module(fmt: str):
    import importlib
    return importlib.import_module(f"ninfer_kernels.gemv_{fmt.split(':')[0]}")


def compile_variant(v: Variant, cc: int):
    from .pdl import compile_const
    mod = _module(v.fmt)
    kernel, wsig, extra = (mod.kernel_for(v.fmt, dequant=v.dequant, cc=cc) if v.fmt in CC_AWARE
                           else mod.kernel_for(v.fmt, dequant=v.dequant))
    if "NW" in extra:
        extra = {**extra, "NW": v.num_warps}
    xt = _TORCH_TO_TRITON[v.x_dtype]
    if v.dequant:
        sig = {**wsig, "out_ptr": f"*{xt}", "fscale": "fp32", "N": "i32", "G": "i32",
               "BLOCK_N": "constexpr", "BLOCK_G": "constexpr"}
        return compile_kernel(kernel, sig, {"BLOCK_N": v.block_n, "BLOCK_G": v.block_g}, cc,
                              divisible=("out_ptr", "G") + tuple(wsig), num_warps=v.num_warps)
    sig = {"x_ptr": "*i32" if v.xpre else f"*{xt}", **wsig,
           **{k: (val or f"*{xt}") for k, val in _BASE_SIG.items()}}
    if v.xpre and "XPRE" not in kernel.arg_names:
        raise ValueError(f"{v.name}: {kernel.__name__} cannot read prepared activations")
    dot_kind = {"float16": 0, "bfloat16": 1}.get(v.x_dtype, 2)
    const = {"T_TILE": v.t_tile, "BLOCK_N": v.block_n, "BLOCK_G": v.block_g, "USE_SPLIT": v.use_split,
             "USE_DOT": v.use_dot, "DOT_KIND": dot_kind, "EPI": v.epi, "EVEN_G": True,
             "FOLD": v.use_dot, "STAGES": 1 if v.use_dot else v.stages, **extra}
    if "XPRE" in kernel.arg_names:
        const["XPRE"] = v.xpre
    if "PDL" in kernel.arg_names:   # griddepcontrol is sm_90 PTX (ninfer_kernels.pdl)
        const["PDL"] = compile_const(cc)
    for k in const:
        sig[k] = "constexpr"
    return compile_kernel(kernel, sig, const, cc, divisible=_DIVISIBLE + tuple(wsig), num_warps=v.num_warps,
                          num_stages=3 if v.use_dot else v.stages)


FORMATS = ("nvfp4", "nvfp4_h2", "nvfp4_mma", "q6_k", "q6_k_h2", "q6_k_mma", "iq3_s", "iq3_s_h2", "iq3_s_mma",
           "iq3_s4", "iq3_s4_h2", "iq3_s4_mma", "f8", "plain:bf16", "plain:f16", "plain:f32")
# kernel_for(..., cc=) picks the target PTX of these
CC_AWARE = ("nvfp4_h2", "q6_k_h2", "iq3_s_h2", "iq3_s4_h2", "nvfp4_mma", "q6_k_mma", "iq3_s_mma", "iq3_s4_mma")
# elementwise-only variants (T <= 8), no dequantizer of their own
NO_DOT = ("nvfp4_h2", "q6_k_h2", "iq3_s_h2", "iq3_s4_h2")
# per-thread kernels: inline PTX must see element e in thread e
LANE_EXACT = ("nvfp4_mma", "q6_k_mma", "iq3_s_mma", "iq3_s4_mma")
# variants that also read prepared activations
XPRE_FORMATS = ("nvfp4_h2", "q6_k_h2", "iq3_s_h2", "iq3_s4_h2", "nvfp4_mma", "q6_k_mma", "iq3_s_mma", "iq3_s4_mma")
# (stages of the T=2 split/residual variant, T=1 (block_n, stages) tiles): the shared h2 skeleton's pipelined
# and plain loops; the per-thread IQ3_S h2 kernel's winning tile (one mode)
_MMA_T16_ROWS = {"iq3_s_mma": 128}   # the T tile 16 compiled per warp-MMA variant: its largest tuner tile
_MMA_STAGES = {"iq3_s_mma": (2,)}      # load depths of a warp-MMA variant's tuner tiles (gemv_iq3_s.MMA_TILES)
_NO_DOT_TILES = {"iq3_s_h2": (1, ((64, 1),)), "iq3_s4_h2": (1, ((64, 1),)), None: (3, ((128, 3), (128, 1)))}
_GS = {"nvfp4": 16, "nvfp4_h2": 16, "q6_k_h2": 16, "q6_k": 16, "iq3_s": 16, "iq3_s_h2": 16, "iq3_s4": 16,
       "iq3_s4_h2": 16, "f8": 8,
       "plain:bf16": 4, "plain:f16": 4, "plain:f32": 2}


def variants(ccs=(70, 90), full: bool = False) -> list[tuple[Variant, int]]:
    """Per target (fp16 activations on sm_70, bf16 on sm_90): every kernel's elementwise path (T tile 2,
    split-K, residual) and tl.dot path (T tile 16), and every dequantizer. `full` adds the decode tiles the
    tuner tries (T 1/4/8/16, 64/128 rows) for register and instruction-count inspection."""
    from .gemv_tiles import FMA_DOT_K, dot_block_g
    out = []
    for cc in ccs:
        xd = "float16" if cc < 80 else "bfloat16"
        for f in FORMATS:
            if f in LANE_EXACT:   # the warp-MMA tiles (gemv_tiles._DECODE_MMA_TILES), T tiles 8 and 16
                if cc < 80:   # sm_70 (never launched there) compiles the emulated warp steps, slowly: one tile
                    out.append((Variant(f, xd, 8, 64, 8, use_split=True, epi=1), cc))
                    continue
                out += [(Variant(f, xd, 8, 128, 8, use_split=True, epi=1, stages=2), cc),
                        (Variant(f, xd, 16, _MMA_T16_ROWS.get(f, 256), 8), cc),
                        (Variant(f, xd, 8, 128, 8, use_split=True, epi=3, stages=2, xpre=f in XPRE_FORMATS), cc)]
                if f in XPRE_FORMATS:     # prepared activations, double (and where a tile has it, triple) buffered
                    out += [(Variant(f, xd, 8, 128, 8, stages=s, xpre=True), cc) for s in _MMA_STAGES.get(f, (2, 3))]
                if full:
                    out += [(Variant(f, xd, 8, 256, 8, stages=2), cc), (Variant(f, xd, 16, 128, 8), cc)]
                continue
            # the tuner's tiles (gemv_tiles.candidates): on sm_70 tl.dot steps FMA_DOT_K weights (no spills)
            bg, bg_dot = 16, dot_block_g(FMA_DOT_K, _GS[f]) if cc < 80 else max(8, 64 // _GS[f])
            # the tuner's default elementwise loop (pipelined loads); `full` has the load-then-decode loop
            st, t1_tiles = _NO_DOT_TILES.get(f, _NO_DOT_TILES[None])
            out.append((Variant(f, xd, 2, 64, bg, use_split=True, epi=1, stages=st), cc))
            # the SwiGLU epilogue of a fused gate/up weight (with its prepared copy where the device reads one)
            out.append((Variant(f, xd, 2, 64, bg, use_split=True, epi=3 if cc >= 80 else 2, stages=st), cc))
            if f in NO_DOT:
                out += [(Variant(f, xd, 1, bn, bg, stages=s), cc) for bn, s in t1_tiles]
                if f in XPRE_FORMATS:      # on prepared activations (bench/xpre.py), T = 1 and 2
                    out += [(Variant(f, xd, 1, t1_tiles[0][0], bg, xpre=True), cc),
                            (Variant(f, xd, 2, 64, bg, use_split=True, epi=1, xpre=True), cc)]
                if full:
                    out += [(Variant(f, xd, t, bn, bg, num_warps=w), cc) for t, bn, w in ((4, 64, 4), (8, 64, 4))]
                continue
            out.append((Variant(f, xd, 16, 64, bg_dot, use_dot=True), cc))
            if not f.startswith("plain"):
                out.append((Variant(f, xd, dequant=True, block_n=32, block_g=8), cc))
            if full:
                for t, bn, w in ((1, 64, 4), (1, 128, 4), (4, 64, 4), (8, 32, 4), (16, 32, 4)):
                    out.append((Variant(f, xd, t, bn, bg, num_warps=w), cc))
                    out.append((Variant(f, xd, t, bn, bg, num_warps=w, stages=3), cc))
                out.append((Variant(f, xd, 16, 128, bg_dot, num_warps=8, use_dot=True, use_split=True), cc))
                if cc < 80:   # the sm_70 fused-prefill tile (gemv_tiles._PREFILL_TILES_FMA)
                    out.append((Variant(f, xd, 32, 128, bg_dot, num_warps=8, use_dot=True), cc))
    return out


def _compile_row(item) -> dict:
    from .pdl import compile_const, ptx_order_ok
    v, cc = item
    t0 = time.time()
    try:
        c = compile_variant(v, cc)
        row = {"variant": v.name, "cc": cc, "ok": True, "seconds": round(time.time() - t0, 2), **summarize(c)}
        pdl = 0 if v.dequant else compile_const(cc)     # every GEMV kernel has the constexpr, no dequantizer
        row["pdl_ok"] = ptx_order_ok(c.asm["ptx"], pdl, late_trigger=True)
        row["evict_first"] = "L2::evict_first" in c.asm["ptx"]   # NINFER_GEMV_EVICT (gemv_common)
        if v.fmt in LANE_EXACT:
            row["lane_layouts_bad"] = lane_layouts_bad(c.asm["ttgir"], v.num_warps)
        return row
    except Exception as e:  # report every failing variant, not only the first
        return {"variant": v.name, "cc": cc, "ok": False, "error": f"{type(e).__name__}: {e}".splitlines()[0]}


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


def _layout_lists(text: str) -> dict:
    return {k: [int(x) for x in re.findall(r"\d+", v)] for k, v in
            re.findall(r"(sizePerThread|threadsPerWarp|warpsPerCTA) = \[([0-9, ]*)\]", text)}


def lane_layouts_bad(ttgir: str, num_warps: int) -> list[str]:
    """The layouts of inline-asm results in a TTGIR module that do not put element e of a [32 * num_warps]
    tensor in thread e (lane e % 32 of warp e // 32): a 1-D blocked layout of one element per thread, or the
    dim-1 slice of a blocked layout whose dimension 0 is spread the same way. Empty when all are exact."""
    defs = dict(re.findall(r"^(#\w+) = (#ttg\.\w+<.*>)$", ttgir, flags=re.M))
    used = set()
    for line in ttgir.splitlines():
        if "elementwise_inline_asm" in line:
            used |= set(re.findall(r"tensor<\d+x\w+, (#\w+|#ttg\.slice<\{dim = 1, parent = #\w+\}>)>", line))
    bad = []
    for lay in sorted(used):
        lin = re.fullmatch(r"#ttg\.linear<\{register = \[\], lane = (.*), warp = (.*), block = \[\]\}>",
                           defs.get(lay, ""))
        if lin and lin.groups() == (str([[1 << i] for i in range(5)]), str([[32 << i] for i in range(
                num_warps.bit_length() - 1)])):
            continue   # the linear form of the same 1-D layout
        m = re.fullmatch(r"#ttg\.slice<\{dim = 1, parent = (#\w+)\}>", lay)
        d = _layout_lists(defs.get(m.group(1) if m else lay, ""))
        spt, tpw, wpc = d.get("sizePerThread", []), d.get("threadsPerWarp", []), d.get("warpsPerCTA", [])
        ok = bool(spt) and spt[0] == 1 and tpw[:1] == [32] and wpc[:1] == [num_warps] \
            and all(t == 1 for t in tpw[1:] + wpc[1:]) and (len(spt) == 1) == (m is None)
        if not ok:
            bad.append(f"{lay} = {defs.get(m.group(1) if m else lay, '?')}")
    return bad


def spill_bytes(compiled) -> int:
    """Bytes of register spill stores, as `ptxas -v` reports them for the kernel's PTX (-1 if unknown): the
    ptxas Triton picks for the target, with its default options (Triton may add its own, e.g. 3.9's register
    allocation level). The cubin's STACK also counts local arrays that are no spill (libdevice's sin/cos argument
    reduction: 32 bytes)."""
    from triton.backends.nvidia.compiler import get_ptxas
    ptx = compiled.asm["ptx"]
    target = re.search(r"^\.target\s+(sm_(\d+)\w*)", ptx, flags=re.M)
    if target is None:
        return -1
    tool = get_ptxas(int(target.group(2))).path
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        r = subprocess.run([tool, "-v", "--gpu-name", target.group(1), f.name, "-o", os.devnull],
                           capture_output=True, text=True)
    m = re.search(r"(\d+) bytes spill stores", r.stdout + r.stderr)
    return int(m.group(1)) if r.returncode == 0 and m else -1


def summarize(compiled) -> dict:
    """Registers, LOCAL / STACK bytes (ptxas puts register spills on the STACK; LOCAL counts local arrays) and
    shared bytes from the cubin, spill-store bytes from ptxas, SASS instruction count where available."""
    usage = _cuda_tool("cuobjdump", compiled, "-res-usage")
    fields = dict(tok.split(":", 1) for line in usage.splitlines() if "REG:" in line for tok in line.split())
    n_instr = len(re.findall(r"^\s*/\*[0-9a-f]{4,}\*/\s+\S", sass(compiled), flags=re.M))
    return {"regs": int(fields.get("REG", -1)), "local": int(fields.get("LOCAL", -1)),
            "stack": int(fields.get("STACK", -1)), "spill": spill_bytes(compiled),
            "shared": int(fields.get("SHARED", -1)), "sass_instr": n_instr}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cc", type=int, nargs="+", default=[70, 90])
    ap.add_argument("--json", action="store_true", help="one JSON list on stdout")
    ap.add_argument("--full", action="store_true", help="also the tuner's decode tiles")
    ap.add_argument("--only", default="", help="substring filter on variant names")
    ap.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1))
    ap.add_argument("--sass", default="", help="print the SASS of the first variant whose name contains this")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("error: unset TRITON_INTERPRET to compile for a GPU target", file=sys.stderr)
        return 2
    todo = [(v, cc) for v, cc in variants(tuple(args.cc), args.full) if args.only in v.name]
    if args.sass:
        v, cc = next(((v, cc) for v, cc in todo if args.sass in v.name), (None, None))
        if v is None:
            print(f"error: no variant matches {args.sass!r}", file=sys.stderr)
            return 2
        print(sass(compile_variant(v, cc)))
        return 0
    if args.jobs > 1 and len(todo) > 1:
        import multiprocessing as mp
        with mp.get_context("spawn").Pool(args.jobs) as pool:
            rows = pool.map(_compile_row, todo, chunksize=1)
    else:
        rows = [_compile_row(item) for item in todo]
    if args.json:
        print(json.dumps(rows))
    else:
        for row in rows:
            print(" ".join(f"{k}={val}" for k, val in row.items()), file=sys.stdout if row["ok"] else sys.stderr)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
