"""bench/decode.py's report side (no torch): the cross-run TP comparison fields, the table rows, the "tp:"
summary lines and the goal lines, all from the JSON records."""
from __future__ import annotations

GOALS = {"decode_pct_roofline_1k": 80.0, "verify_ratio_k3": 1.25, "prefill_tok_s": 8000.0, "load_s": 10.0}


def _match(records: list, r: dict, **want):
    keys = ("recipe", "kind", "context", "draft_tokens")
    for o in records:
        if all(o.get(k) == r.get(k) for k in keys) and all(o.get(k) == v for k, v in want.items()):
            return o
    return None


def compare_tp(records: list) -> None:
    """Cross-run fields, in place: TP > 1 decode / verify records get TP1's numbers at the same recipe and
    context and the speedup; decode records get every all-reduce implementation's step time at their TP."""
    for r in records:
        if r["kind"] not in ("decode", "verify") or r.get("tp", 1) < 2:
            continue
        tp1 = _match(records, r, tp=1)
        if r["kind"] == "decode":
            same = [o for o in records if o["kind"] == "decode" and o["tp"] == r["tp"]
                    and o["recipe"] == r["recipe"] and o["context"] == r["context"] and "allreduce" in o]
            names = [o["allreduce"] for o in same]          # "always" without peer memory: one path twice
            keys = [n + " forced" if o.get("allreduce_forced") and names.count(n) > 1 else n
                    for n, o in zip(names, same)]
            r["ms_step_by_allreduce"] = {k: o["ms_step"] for k, o in zip(keys, same)}
            r["tok_s_by_allreduce"] = {k: o["tok_s"] for k, o in zip(keys, same)}
        if tp1 is not None:
            key = "tok_s" if r["kind"] == "decode" else "verify_ratio"
            r[f"{key}_tp1"] = tp1[key]
            if r["kind"] == "decode":
                r["speedup_vs_tp1"] = r["tok_s"] / tp1["tok_s"]
                r["speedup_vs_tp1_gpu"] = r["tok_s_gpu"] / tp1["tok_s_gpu"]


# ---- table ----
def row(r: dict) -> str | None:
    k = r["kind"]
    head = f"{r.get('recipe', ''):<7}{r.get('tp', ''):>3}  {k:<8}"
    if k == "decode":
        alt = f"sync {r['ms_step_sync']:.3f}, " if "ms_step_sync" in r else ""
        return (f"{head}{r['context']:>7}  K=0 {r['tok_s']:9.1f} tok/s {r['ms_step']:8.3f} ms "
                f"({alt}gpu {r['ms_step_gpu']:.3f}) {r['bytes_step'] / 1e9:7.2f} GB/step {r['pct_roofline']:6.1f}% "
                f"roofline (gpu {r['pct_roofline_gpu']:.1f}%)" + _tp_note(r))
    if k == "allreduce":
        msgs = ", ".join(f"{m['count']} x {m['bytes']} B" for m in r["allreduce_messages"])
        per = ", ".join(f"{i} {r['allreduce_us_per_call'][i]:.1f} us/call = {us / 1e3:.3f} ms/step"
                        for i, us in r["allreduce_us_per_step"].items())
        return f"{head}{'':>7}      {msgs} per decode step: {per} ({r['allreduce_timing']})"
    if k == "verify":
        extra = ""
        if r.get("tok_s_by_acceptance"):
            extra = " tok/s@a=" + "/".join(f"{v:.0f}" for v in r["tok_s_by_acceptance"].values()) + \
                    f" (a={'/'.join(r['tok_s_by_acceptance'])}; draft {r['draft_ms']:.3f} ms)"
            if r.get("draft_ms_chained") is not None:     # drafts fed back on the device (NINFER_DRAFT_CHAIN)
                extra += f"; chained draft {r['draft_ms_chained']:.3f} ms: {r['tok_s_chained']:.0f} tok/s"
        rounds = r.get("verify_ratio_rounds") or ()
        spread = f" (rounds {min(rounds):.3f}-{max(rounds):.3f})" if len(rounds) > 1 else ""
        gpu = ""
        if "ms_step_gpu" in r:       # no read-back per step: the GPU's time; the host's part of a synced step
            gpu = (f"; gpu {r['ms_step_gpu']:.3f} ms = {r['verify_ratio_gpu']:.3f} x, host {r['host_ms']:.3f} "
                   f"(K=0 {r['host_ms_k0']:.3f}) ms")
        return (f"{head}{r['context']:>7}  K={r['draft_tokens']} {r['ms_step']:8.3f} ms = "
                f"{r['verify_ratio']:.3f} x K=0{spread}{extra}{gpu}")
    if k == "profile":
        if "us_by_group" not in r:
            return f"{head}{r['context']:>7}      {r.get('note', 'no kernels traced')}"
        groups = ", ".join(f"{g} {us:.0f}" for g, us in sorted(r["us_by_group"].items(), key=lambda kv: -kv[1]))
        excl = ""
        if "excl_us_by_group" in r:      # each kernel's share of the timeline (overlaps counted once)
            excl = "; exclusive: " + ", ".join(f"{g} {us:.0f}" for g, us in sorted(
                r["excl_us_by_group"].items(), key=lambda kv: -kv[1])) + f", idle {r['idle_us_per_step']:.0f}"
            if r.get("idle_top"):        # where the idle time falls, by the pair of kernels around it
                excl += " (" + ", ".join(f"{k} {us:.0f} us/{n:g}" for k, us, n in r["idle_top"][:3]) + ")"
        return (f"{head}{r['context']:>7}      {r.get('step', 'decode')}: {r['kernels_per_step']:.0f} kernels, "
                f"{r['kernel_us_per_step']:.0f} us of kernels per step ({r['source']}): {groups}{excl}"
                + _by_shape(r.get("linear_by_shape")))
    if k == "prefill":
        return (f"{head}{r['tokens']:>7}      {r['tok_s']:9.1f} tok/s {r['s']:8.3f} s  {r['tflops']:.1f} TFLOP/s "
                f"= {r['pct_matmul_peak']:.1f}% of matmul peak")
    if k == "load":
        return (f"{head}{'':>7}      load {r['load_s']:.2f} s ({r['file_bytes'] / 1e9:.2f} GB, {r['gbps']:.2f} GB/s, "
                f"checksums) build {r['model_build_s']:.2f} s "
                + (f"precompile {r['precompile_s']:.0f} s " if r.get("precompile_s") is not None else "")
                + (f"capture {r['capture_s']:.1f} s ({r['graphs_captured']} graphs)" if r["capture_s"] is not None
                   else "graph capture FAILED (eager)") + _mem_note(r))
    if k == "ceilings":
        return f"{head}{'':>7}      copy {r['copy_tbps']:.3f} TB/s  matmul {r['matmul_tflops']:.1f} TFLOP/s  ({r['gpu']})"
    if k in ("error", "skipped"):
        return f"{head}{r.get('error') or r.get('reason')}"
    return None


def _tp_note(r: dict) -> str:
    if "allreduce" not in r:
        return ""
    share = r.get("allreduce_pct_step")
    note = (f"  [{r['allreduce']}{' forced' if r.get('allreduce_forced') else ''}: {r['allreduce_calls_per_step']} "
            f"all-reduces/step" + (f" = {share:.1f}% of the step" if share is not None else "") + "]")
    return note + (f" {r['speedup_vs_tp1']:.2f}x TP1" if "speedup_vs_tp1" in r else "")


def _mem_note(r: dict) -> str:
    fmt = lambda v: "/".join(f"{x:.2f}" for x in v)
    if "max_allocated_gib" in r:
        return (f"; GiB per rank: max allocated {fmt(r['max_allocated_gib'])}, reserved {fmt(r['reserved_gib'])}, "
                f"device used {fmt(r['device_used_gib'])}")
    return f"; peak RSS GiB per rank {fmt(r['peak_rss_gib'])}" if "peak_rss_gib" in r else ""


def _by_shape(shapes: dict | None) -> str:
    """The GEMVs per weight: us per launch, whole / exclusive, and the exclusive us per step."""
    if not shapes:
        return ""
    if "note" in shapes:
        return f"; by shape: {shapes['note']}"
    return "; GEMV us per launch (whole/exclusive, step total): " + ", ".join(
        f"{k} {us / n:.1f}/{x / n:.1f} ({x:.0f})" for k, (us, x, n) in sorted(shapes.items(), key=lambda kv: -kv[1][1]))


def tp_summary(records: list) -> list[str]:
    """One line per TP > 1 decode measurement with the peer-memory path (or the only one): tok/s against TP1
    and against the process-group all-reduce."""
    out = []
    for r in records:
        if r["kind"] != "decode" or r.get("tp", 1) < 2 or r.get("allreduce_forced"):
            continue
        line = f"{r['recipe']} TP{r['tp']} @{r['context']}: {r['tok_s']:.1f} tok/s ({r['allreduce']})"
        if "tok_s_tp1" in r:
            line += f" vs TP1 {r['tok_s_tp1']:.1f} tok/s = {r['speedup_vs_tp1']:.2f}x"
        others = {i: t for i, t in r.get("tok_s_by_allreduce", {}).items() if i != r["allreduce"]}
        line += "".join(f"; with {i}: {t:.1f} tok/s" for i, t in others.items())
        per = r.get("allreduce_us_per_step", {})
        line += "; all-reduce ms/step " + ", ".join(f"{i} {us / 1e3:.3f}" for i, us in per.items())
        out.append(line)
    return out


def goals(records: list) -> list[str]:
    out = []
    for r in records:
        if r.get("recipe") != "nvfp4" or r.get("allreduce_forced"):
            continue
        if r["kind"] == "decode" and r["context"] <= 1024:
            out.append(f"nvfp4 TP{r['tp']} decode @{r['context']}: {r['pct_roofline']:.1f}% of roofline "
                       f"(goal >= {GOALS['decode_pct_roofline_1k']:.0f}%)")
        elif r["kind"] == "verify" and r["draft_tokens"] == 3:
            out.append(f"nvfp4 TP{r['tp']} verify K=3: {r['verify_ratio']:.3f} x K=0 "
                       f"(goal <= {GOALS['verify_ratio_k3']})")
        elif r["kind"] == "prefill":
            out.append(f"nvfp4 TP{r['tp']} prefill {r['tokens']}: {r['tok_s']:.0f} tok/s "
                       f"(goal >= {GOALS['prefill_tok_s']:.0f})")
        elif r["kind"] == "load":
            out.append(f"nvfp4 TP{r['tp']} load: {r['load_s']:.2f} s (goal <= {GOALS['load_s']:.0f} s)")
    return out
