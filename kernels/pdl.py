"""Programmatic dependent launch (PDL, sm_90+) for the decode step's kernels: on by default where the device has it
(NINFER_PDL=0 turns it off). On the H200 it took the 27B nvfp4 decode step from 6.72 to 6.22 ms (bench/NOTES.md §16).

Why: Nsight Compute on the T = 1 GEMV found the SMs without any CTA for 18-20 % of each kernel's time (its ramp and
tail), and a decode step is ~730 kernels in a CUDA graph. Launched with PDL, a kernel's CTAs may be scheduled
before the kernel in front completes, so its launch and placement overlap that kernel's tail.

Protocol, for every kernel with a `PDL` constexpr (0 = off; `pdl_kw` decides):
  * each CTA calls `griddepcontrol.launch_dependents` (the trigger): the next PDL-launched kernel may be scheduled
    once all CTAs of this one have done so (or exited). Short kernels trigger first (`pdl_enter`); the GEMVs
    trigger after their K loop (`gemv_common.finish_at`). A GEMV that triggered at its start let the next
    kernels, each triggering at its start, be placed on the SMs one after another while it ran, each where room
    happened to be, and decode lost 16 % (bench/NOTES.md §16); a late trigger lets at most the short kernels
    behind a GEMV and the next GEMV in.
    Behind a chain of short kernels the same cascade places the next GEMV's CTAs during the first of them:
    the kernels named in NINFER_PDL_LATE (`late_kernels`: by default the attention combine, in verify steps)
    trigger at their end instead.
  * before it reads anything an earlier kernel wrote, and before it writes anything (its outputs, a workspace or a
    counter that an earlier kernel may still read), each CTA calls `griddepcontrol.wait`, which returns once the
    kernel in front has completed and its memory is visible. Every CTA waits (no CTA returns before the wait), so
    a kernel completes only after the one in front did, and completion is transitive down the chain. Nothing is
    loaded before the wait by the GEMVs, not even weights: the registers that held the T = 1 GEMV's first tile cost
    it one CTA per SM (96 -> 128 registers) and decode 17 % (§16).
  * preload (NINFER_PDL_PRELOAD=1, the default): the norms (`rmsnorm`, `gated_rmsnorm`, `rmsnorm_gates`) load their
    gains, which no kernel writes, before the wait (`pdl_enter_preloaded`; `rmsnorm_gates` also its b/a weight rows),
    so that load's memory latency overlaps the wait instead of following it. Their launchers ask
    `pdl_kw(device, preload=True)`, which adds the `PRELOAD` constexpr.
  * state (NINFER_PDL_STATE=1, the default): the GDN convs (`gdn_conv.conv_step_kernel` for decode,
    `gdn_conv.causal_conv_kernel` for verify and prefill chunks) and the recurrence (`gdn_recurrent`) load the step
    metadata (offsets, slots, snapshot rows), their weights and the sequence's state (the conv window, the
    64 KB-per-head fp32 recurrence tile) before the wait, as `PRELOAD` too (their launchers ask
    `pdl_kw(device, state=True)`). These are written only by host copies, torch copies and the same
    kernels themselves in an earlier step, and a kernel placed early has a GEMV in front of it that triggers only
    after its own wait (the conv's, or the recurrence's behind the conv, which triggers at its start): so every
    such write has completed before the CTA exists. What still depends on the kernel in front (the projections,
    the conv output, the gates) is loaded after the wait. On the H200: decode 6.004 -> 5.935 / 5.942 ms, verify
    K = 3 -30 us (bench/NOTES.md §29). Whichever of the two kernels is behind the GDN gates' join (a plain graph
    edge, `ninfer_rt.backends.side_stream`) is not placed early and gains nothing from it.
Kernels launched without the attribute (torch's, NCCL's) start after the kernel in front completes, as always, and
never trigger early, so a PDL kernel behind them starts as it would without PDL.
"""
from __future__ import annotations

import functools
import os

import triton
import triton.language as tl

PDL_ENV = "NINFER_PDL"
PDL_MODES = ("0", "1")
PRELOAD_ENV = "NINFER_PDL_PRELOAD"
STATE_ENV = "NINFER_PDL_STATE"
MMA_ENV = "NINFER_PDL_MMA"
LATE_ENV = "NINFER_PDL_LATE"
LATE_KERNELS = ("recurrence", "combine", "gated_norm")
LATE_DEFAULT = "combine"


@triton.jit
def pdl_trigger(PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """Trigger, then wait: the start of a kernel with no work that is independent of the kernel in front."""
    pdl_trigger(PDL)
    pdl_wait(PDL)


def _mode(name: str, default: str = "1") -> str:
    """'1' or '0' from the environment variable `name` (unset: `default`); anything else is a one-line error naming
    it."""
    v = os.environ.get(name, default)
    if v not in PDL_MODES:
        from .ops_common import KernelInputError
        raise KernelInputError(f"{name}={v!r}: expected one of {', '.join(PDL_MODES)}")
    return v


@triton.jit
def pdl_enter_preloaded(ptrs, mask, PDL: tl.constexpr, PRELOAD: tl.constexpr, LATE: tl.constexpr = 0):
    """`pdl_enter` that also loads `ptrs` (data no kernel writes, e.g. a norm's gain; masked, 0 elsewhere) as fp32:
    issued before the wait with PRELOAD, so its memory latency overlaps the wait; after it otherwise. LATE: no
    trigger here (the kernel triggers at its end, NINFER_PDL_LATE)."""
    if not LATE:
        pdl_trigger(PDL)
    if PRELOAD:
        v = tl.load(ptrs, mask=mask, other=0.0)
    pdl_wait(PDL)
    if not PRELOAD:
        v = tl.load(ptrs, mask=mask, other=0.0)
    return v.to(tl.float32)


def pdl_mode() -> str:
    """NINFER_PDL: '1' (default: on where the device has it) or '0'."""
    return _mode(PDL_ENV)


def preload_mode() -> str:
    """NINFER_PDL_PRELOAD: '1' (default: the norms load their gains before the wait) or '0' (a comparison switch)."""
    return _mode(PRELOAD_ENV)


def state_mode() -> str:
    """NINFER_PDL_STATE: '1' (the default: the GDN conv and recurrence load their state before the wait) or '0'
    (after it; a comparison switch)."""
    return _mode(STATE_ENV)


def mma_mode() -> str:
    """NINFER_PDL_MMA: '1' (default: the warp-MMA GEMVs launch with PDL like every other kernel) or '0' (they
    launch plainly, after the kernel in front completes; a comparison switch, bench/NOTES.md §23)."""
    return _mode(MMA_ENV)


def late_kernels() -> frozenset:
    """NINFER_PDL_LATE: a comma list of LATE_KERNELS that trigger their dependents at their end instead of their
    start, or "none". Default `combine`: in verify steps (more than one query row per sequence) the attention
    combine lets the o_proj GEMV in only once it has merged, instead of during the attention kernel in front. On
    the H200, verify K = 3 took 7.052 / 7.085 / 7.087 ms of GPU time against 7.110 / 7.114 / 7.117 / 7.137 with
    none, on two machines; decode steps keep the early trigger, since their K = 0 time did not gain (5.910 against
    5.909 on one machine, 5.945 / 5.951 against 5.918 / 5.932 on the other); the recurrence and the gated norm
    late did not help decode either (bench/NOTES.md §31). So `combine` acts in verify steps only (its launcher,
    `attention_decode._run`, asks for it there), while `recurrence` and `gated_norm` act in every step."""
    v = os.environ.get(LATE_ENV, LATE_DEFAULT).strip()
    names = frozenset(n.strip() for n in v.split(",") if n.strip()) if v not in ("", "none") else frozenset()
    if not names <= set(LATE_KERNELS):
        from .ops_common import KernelInputError
        raise KernelInputError(f"{LATE_ENV}={v!r}: expected 'none' or a comma list of {', '.join(LATE_KERNELS)}")
    return names


def pdl_kw(device, preload: bool = False, state: bool = False, late: str = "") -> dict:
    """The extra launch arguments of a PDL-capable kernel on `device`: {"PDL": 1, "launch_pdl": True} with
    NINFER_PDL=1 (the default) on a CUDA device of compute capability 9.0+ (griddepcontrol is sm_90 PTX), else {}
    (sm_70 / sm_80, the interpreter, the CPU, or NINFER_PDL=0). preload / state: the kernel has a `PRELOAD`
    constexpr, given as NINFER_PDL_PRELOAD (a norm's gain) / NINFER_PDL_STATE (the GDN state) says when PDL is on.
    late: the kernel's name in LATE_KERNELS; its `LATE` constexpr is 1 when NINFER_PDL_LATE names it."""
    if pdl_mode() == "0" or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return {}
    if getattr(device, "type", "cuda") != "cuda" or _capability(getattr(device, "index", None)) < (9, 0):
        return {}
    early = {"PRELOAD": int(preload_mode())} if preload else {"PRELOAD": int(state_mode())} if state else {}
    if late:
        early["LATE"] = int(late in late_kernels())
    return {"PDL": 1, "launch_pdl": True, **early}


@functools.lru_cache(maxsize=None)
def _capability(index) -> tuple:
    import torch
    return torch.cuda.get_device_capability(index)


def compile_const(cc: int) -> int:
    """The PDL constexpr the no-GPU compile checks give a kernel that has one, for CUDA capability `cc`: the
    protocol compiled in on sm_90+, where launches use it."""
    return int(cc >= 90)


def ptx_order_ok(ptx: str, pdl: int, late_trigger: bool = False, preload: int = 0) -> bool | None:
    """For a compile check: None when `pdl` is 0; else whether the PTX has both griddepcontrol instructions and
    waits before its first global load and store (with `preload`: before its first store, and it loads before
    the wait); with `late_trigger` (the GEMVs) also whether it triggers only after a global load (after its K
    loop, not at its start)."""
    if not pdl:
        return None
    wait, trig = ptx.find("griddepcontrol.wait"), ptx.find("griddepcontrol.launch_dependents")
    loads = [i for i in (ptx.find("ld.global"), ptx.find("cp.async")) if i >= 0]   # cp.async: pipelined loads
    load = min(loads) if loads else -1
    if preload:
        store = ptx.find("st.global")
        return 0 <= load < wait and trig >= 0 and (store < 0 or wait < store)
    mem = [i for i in (ptx.find("st.global"), load) if i >= 0]
    ok = wait >= 0 and trig >= 0 and (not mem or wait < min(mem))
    return ok and (not late_trigger or 0 <= load < trig)
