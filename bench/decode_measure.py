"""The measurements of bench/decode.py, one function each: bytes per step, context filling, and the timed
decode / verify / draft / prefill loops (the ceilings are bench_device's). Everything takes the model (or
graph runner) already built; `decode_rank.py` strings them together per TP rank.
"""
from __future__ import annotations

import math
import time

import bench_device as D
import torch

from ninfer_rt.model import MtpInput, SeqInput


# ---- bytes per step ----
def weight_bytes(model) -> dict:
    """Bytes a decode step reads from weights: every layer, the final norm and lm_head (target); the MTP
    module apart. The embedding table is left out (one row per token is read)."""
    seen = set()
    target = D.tensors([model.blocks, model.norm, model.lm_head], seen)
    mtp = D.tensors(model.mtp, seen) if model.mtp is not None else []
    return {"target": sum(t.nbytes for t in target), "mtp": sum(t.nbytes for t in mtp)}


def layer_params(model) -> int:
    """Logical parameters of the decoder layers' linear weights (excludes embedding, lm_head, MTP)."""
    return sum(w.shape[0] * w.shape[1] for w in D.qweights(model.blocks))


def state_bytes(model, kv_len: int, tokens: int = 1, snapshot: bool = False) -> int:
    """KV read (+ the new tokens' writes) over the main attention layers, GDN states read + written (and the
    per-token snapshot writes of a verify step; the graph runner's commit copies nothing)."""
    kv = model.kv_pool
    n_main = kv.k.shape[0] - (model.mtp is not None)
    per_tok = 2 * kv.k[0, 0, 0].numel() * kv.k.element_size()           # K and V of one token, one layer
    kv_bytes = n_main * per_tok * (kv_len + tokens)
    rec, conv = model.gdn_pool.rec[0, 0], model.gdn_pool.conv[0, 0]
    slot = rec.numel() * rec.element_size() + conv.numel() * conv.element_size()
    gdn = model.n_gdn * slot * (2 + (tokens if snapshot else 0))
    return kv_bytes + gdn


# ---- context ----
def fill_context(model, state, length: int) -> None:
    """Make `state` look like a sequence of `length` tokens without a prefill: random KV in every attention
    layer (the MTP layer too) and random GDN states, drawn on the device (seed with torch.manual_seed).
    Timing does not depend on the values."""
    state.ensure_capacity(length + 1)
    ps, kv, pool = model.kv_pool.page_size, model.kv_pool, model.gdn_pool
    idx = torch.tensor(state.pages[:math.ceil(length / ps)], dtype=torch.long, device=kv.k.device)
    shape = (len(idx), ps) + tuple(kv.k.shape[3:])
    for layer in range(kv.k.shape[0]):
        for cache in (kv.k, kv.v):
            cache[layer].index_copy_(0, idx, torch.randn(shape, device=cache.device, dtype=cache.dtype))
    rec, conv = pool.rec[:, state.slot], pool.conv[:, state.slot]
    rec.copy_(torch.randn(rec.shape, device=rec.device) * 0.01)
    conv.copy_(torch.randn(conv.shape, device=conv.device))
    state.length = length
    if state.mtp is not None:
        state.mtp.length = length


def rewind(state, length: int) -> None:
    """Back to `length` tokens (KV past it is stale and gets overwritten; the GDN state just keeps evolving)."""
    state.length = length
    if state.mtp is not None:
        state.mtp.length = min(state.mtp.length, length)
    state.trim()


# ---- timed loops ----
def _timed(step, steps: int, warm: int, device) -> float:
    """ms per step: `warm` untimed steps, then `steps` timed ones, one sync at the end."""
    for _ in range(warm):
        step()
    D.sync(device)
    t = time.perf_counter()
    for _ in range(steps):
        step()
    D.sync(device)
    return (time.perf_counter() - t) / steps * 1e3


DECODE_MODES = ("ahead", "sync", "gpu")


def decode_ms(runner, state, steps: int, warm: int, *, mode: str) -> float:
    """Greedy decode of one sequence, its token fed back one of three ways: "ahead" launches step n+1 from step
    n's device token, then reads step n's back (the engine's run-ahead decode, ninfer_rt/engine_ahead.py);
    "sync" reads each token back before the next step (the engine without it: one host sync per step); "gpu"
    never reads back (GPU time per step, steps pipelined)."""
    if mode not in DECODE_MODES:
        raise ValueError(f"decode_ms: mode {mode!r} is not one of {DECODE_MODES}")
    cuda = runner.model.device.type == "cuda"
    tok, prev = [torch.tensor([1])], [None]       # next step's ids; step n's (host copy, event)
    base = state.length

    def step():
        out = runner.forward([SeqInput(tok[0], state)])
        t = out.logits[-1:].argmax(-1)
        tok[0] = t.cpu() if mode == "sync" else t
        if mode == "ahead":
            host = torch.empty(1, dtype=torch.long, pin_memory=cuda)
            host.copy_(t, non_blocking=cuda)
            ev = torch.cuda.Event() if cuda else None
            if ev is not None:
                ev.record()
            if prev[0] is not None:
                if prev[0][1] is not None:
                    prev[0][1].synchronize()
                prev[0][0].tolist()
            prev[0] = (host, ev)
    ms = _timed(step, steps, warm, runner.model.device)
    rewind(state, base)
    return ms


def verify_ms(runner, state, k: int, steps: int, warm: int, gen: torch.Generator, *, sync: bool = True,
              host: list | None = None) -> float:
    """A target forward over [t_0, d_1..d_k] with GDN snapshots, then commit of all k+1 (k = 0: plain decode);
    the verdict needs the logits on the host each round. sync=False: nothing is read back, so the steps pipeline
    and the time is the GPU's (unless the host's part is longer). host: gets the host's ms per step in forward +
    commit (input copies, graph launch, bookkeeping), which with sync the GPU waits for."""
    ids = torch.randint(0, runner.model.cfg.vocab_size, (k + 1,), generator=gen)
    base, spent = state.length, [0.0]

    def step():
        t = time.perf_counter()
        out = runner.forward([SeqInput(ids, state, snapshot=k > 0)])
        if k:
            state.commit(k + 1)
        spent[0] += time.perf_counter() - t
        if sync:
            out.logits.argmax(-1).cpu()
    ms = _timed(step, steps, warm, runner.model.device)
    if host is not None:
        host.append(spent[0] / (steps + warm) * 1e3)
    rewind(state, base)
    return ms


VERIFY_ROUNDS = 4   # K = 0..max timed in turn this many times (bench/NOTES.md §20: the ratio drifted 1.22-1.28)


def verify_rounds(runner, state, ks, steps: int, warm: int, gen: torch.Generator,
                  rounds: int = VERIFY_ROUNDS, *, sync: bool = True, host: dict | None = None) -> dict[int, list[float]]:
    """{k: ms per step in each round}: every round times each k in `ks` for steps / rounds steps (after `warm`
    untimed ones), so a k's time and K = 0's come from the same minute of the machine's drift. sync, host: as
    `verify_ms` (host: {k: list} gets each round's host ms)."""
    per = max(1, steps // rounds)
    out: dict[int, list[float]] = {k: [] for k in ks}
    for _ in range(rounds):
        for k in ks:
            out[k].append(verify_ms(runner, state, k, per, warm, gen, sync=sync,
                                    host=None if host is None else host.setdefault(k, [])))
    return out


def draft_ms(runner, state, steps: int, warm: int, chained: bool = False) -> float:
    """One MTP draft step (T = 1, the previous MTP hidden in), its argmax read back to the host; `chained`:
    the argmax stays on the device as the next step's input, as the engine drafts greedy requests
    (NINFER_DRAFT_CHAIN)."""
    m = runner.model
    cur = [torch.tensor([1]), torch.zeros(1, m.cfg.hidden_size, dtype=m.dtype, device=m.device)]
    base = state.mtp.length

    def step():
        out = runner.mtp_forward([MtpInput(cur[0], cur[1], state.mtp)])
        tok = out.logits.argmax(-1)
        cur[0], cur[1] = (tok if chained else tok.cpu()), out.hidden
    ms = _timed(step, steps, warm, m.device)
    state.mtp.rewind(base)
    return ms


def prefill_s(model, tokens: int, chunk: int, gen: torch.Generator) -> float:
    """Seconds for an eager prefill of `tokens` random ids in chunks of `chunk` (logits of the last only)."""
    ids = torch.randint(0, model.cfg.vocab_size, (tokens,), generator=gen)
    st = model.new_state()
    try:
        D.sync(model.device)
        t = time.perf_counter()
        for a in range(0, tokens, chunk):
            b = min(tokens, a + chunk)
            model.forward([SeqInput(ids[a:b], st, logits="last" if b == tokens else "none")])
        D.sync(model.device)
        return time.perf_counter() - t
    finally:
        st.free()


_GROUPS = (("gemv", "linear"), ("matmul", "linear"), ("gemm", "linear"), ("attn", "attention"),
           ("kv_write", "attention"), ("rope", "attention"), ("gdn", "gdn"), ("conv", "gdn"), ("norm", "norms"),
           ("silu", "elementwise"), ("sigmoid", "elementwise"), ("memcpy", "copies"), ("memset", "copies"),
           ("copy", "copies"), ("argmax", "sampling"), ("index", "embedding"))


def _group(name: str) -> str:
    low = name.lower()
    return next((grp for key, grp in _GROUPS if key in low), "other")


def _exclusive(events: list, steps: int) -> tuple[dict, float]:
    """Per kernel name, the microseconds per step during which it was the kernel that ran last to finish: each
    kernel gets (its end - max(its start, the latest end before it)), so kernels that overlap (programmatic
    dependent launch starts CTAs early; they then wait) share the timeline instead of each counting it whole;
    also the idle microseconds per step between kernels."""
    per_event, gaps = _exclusive_events(events)
    excl: dict[str, float] = {}
    for e, us in per_event:
        excl[e.name] = excl.get(e.name, 0.0) + us / steps
    return excl, sum(us for _, _, us in gaps) / steps


def _exclusive_events(events: list) -> tuple[list, list]:
    """[(event, its exclusive microseconds)] in start order (`_exclusive`), and the idle gaps between kernels as
    [(the kernel that ended last, the next to start, microseconds)]."""
    out, gaps, last, last_name = [], [], None, None
    for e in sorted(events, key=lambda e: e.time_range.start):
        start, end = e.time_range.start, e.time_range.end
        if last is not None and start > last:
            gaps.append((last_name, e.name, start - last))
        lo = start if last is None else max(start, last)
        out.append((e, max(0.0, end - lo)))
        if last is None or end >= last:
            last, last_name = end, e.name
    return out, gaps


def idle_by_transition(events: list, steps: int, top: int = 6) -> list:
    """Where the idle time falls: [["previous kernel -> next kernel", idle us per step, gaps per step]] for the
    `top` pairs with the most (names cut to 40 characters; the previous kernel is the one that ended last)."""
    acc: dict[str, list] = {}
    for prev, nxt, us in _exclusive_events(events)[1]:
        a = acc.setdefault(f"{prev[:40]} -> {nxt[:40]}", [0.0, 0.0])
        a[0] += us / steps
        a[1] += 1 / steps
    return [[k, round(us, 2), round(n, 2)] for k, (us, n) in sorted(acc.items(), key=lambda kv: -kv[1][0])[:top]]


def linear_by_shape(events: list, steps: int, labels: list[str]) -> dict:
    """The GEMV launches of a step by the weight they read: `labels` names a step's GEMV launches in launch order
    (e.g. per layer qkv, o, gate_up, down, then lm_head); {label: [us, exclusive us, launches] per step}, or
    {"note": ...} when the trace has a different number of GEMV launches per step."""
    gemvs = [(e, x) for e, x in _exclusive_events(events)[0] if "gemv" in e.name.lower()]
    if not labels or len(gemvs) != steps * len(labels):
        return {"note": f"{len(gemvs)} GEMV launches for {steps} steps of {len(labels)} labels"}
    out: dict[str, list] = {}
    for i, (e, x) in enumerate(gemvs):
        acc = out.setdefault(labels[i % len(labels)], [0.0, 0.0, 0.0])
        acc[0] += (e.time_range.end - e.time_range.start) / steps
        acc[1] += x / steps
        acc[2] += 1 / steps
    return out


def kernel_profile(step, steps: int, top: int = 15, linear_labels: list[str] | None = None) -> dict:
    """GPU kernels of `steps` calls of step() under the torch profiler: count and microseconds per step, by
    kernel name and by coarse group (linear, attention, gdn, norms, ...), each kernel's whole duration and its
    exclusive share of the timeline (`_exclusive`); with linear_labels also by GEMV weight (`linear_by_shape`).
    {} if nothing was traced."""
    from torch.profiler import ProfilerActivity, profile
    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name: dict[str, list] = {}
    for e in events:
        acc = by_name.setdefault(e.name, [0.0, 0])
        acc[0] += e.time_range.elapsed_us() / steps
        acc[1] += 1 / steps
    if not by_name:
        return {}
    excl, gap = _exclusive(events, steps)
    groups: dict[str, float] = {}
    groups_x: dict[str, float] = {}
    for name, (us, _) in by_name.items():
        g = _group(name)
        groups[g] = groups.get(g, 0.0) + us
        groups_x[g] = groups_x.get(g, 0.0) + excl.get(name, 0.0)
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])
    shapes = {"linear_by_shape": linear_by_shape(events, steps, linear_labels)} if linear_labels else {}
    return {**shapes, "kernels_per_step": sum(n for _, n in by_name.values()),
            "kernel_us_per_step": sum(us for us, _ in by_name.values()), "us_by_group": groups,
            "excl_us_by_group": groups_x, "idle_us_per_step": gap, "idle_top": idle_by_transition(events, steps),
            "top": [[name[:80], us, n, excl.get(name, 0.0)] for name, (us, n) in ranked[:top]]}


def spec_tok_s(verify: float, draft: float, k: int, a: float) -> tuple[float, float]:
    """(expected tokens per round, tok/s) for per-position acceptance a: sum_{i=0..k} a^i tokens per
    verify_time(k) + k * draft_time."""
    tokens = sum(a ** i for i in range(k + 1))
    return tokens, tokens / ((verify + k * draft) / 1e3)
