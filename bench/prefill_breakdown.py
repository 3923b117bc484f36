"""Attribution of one profiled prefill's kernels to layers, ops and categories, and the extrapolation to the
full layer count. Pure functions over plain records, so the logic is testable without a GPU or a profiler.

Inputs (times in microseconds on the profiler's clock):
  kernels    [(name, start_us, dur_us[, launch_us])]: GPU kernels / memcpys with the host time of their launch
             when known (CPU run: the top-level aten ops)
  sections   [(label, start_us, end_us)]: "setup", "embed", "layer:<i>:<gdn|attn>", "head"
  op_ranges  [(op, start_us, end_us)]: one per call of an ops-backend method (linear, gdn_chunk, ...)
The profiled run synchronizes the device before each range closes, so a kernel runs inside the ranges its
launch was made in; it is attributed by the midpoint of its execution (by its launch if that midpoint lies
outside every section).
"""
from __future__ import annotations

import bisect
from collections import defaultdict

CATEGORIES = ("linear_gemm", "dequant", "gdn_chunk", "gdn_gates", "conv", "attention", "kv_write", "norms",
              "rope", "elementwise_copies", "embedding", "other")
TYPES = ("setup", "embed", "gdn", "attn", "head", "unattributed")

# kernels that only move or cast data, whatever op launched them
_COPY = ("memcpy", "memset", "elementwise", "copy", "catarray", "aten::cat", "indexselect", "index_select",
         "index_copy", "indexfunc", "index_elementwise", "fill", "gather", "scatter", "repeat", "aten::to",
         "aten::clone", "contiguous", "aten::zero", "aten::expand")
_OP_CATEGORY = {"linear": "linear_gemm", "embedding": "embedding", "rmsnorm": "norms", "add_rmsnorm": "norms",
                "gated_rmsnorm": "norms", "silu_mul": "elementwise_copies", "sigmoid_gate": "elementwise_copies",
                "rope": "rope", "kv_write": "kv_write", "attention": "attention", "causal_conv": "conv",
                "gdn_gates": "gdn_gates", "gdn_chunk": "gdn_chunk", "gdn_recurrent": "gdn_chunk"}
# ops that compose two others on some backends (ninfer_rt/ops.py): their kernels named like the inner op's take
# that op's category, the rest the composite's
_COMPOSITE = {"gated_attention": ("attention", (("sigmoid", "elementwise_copies"),)),
              "qk_norm_rope_store": ("rope", (("kv_write", "kv_write"), ("index_copy", "kv_write"))),
              "linear_swiglu": ("linear_gemm", (("dequant", "dequant"), ("silu_mul", "elementwise_copies")))}
# by kernel name alone (kernels launched outside any op range)
_BY_NAME = (("dequant", "dequant"),
            ("gated_delta", "gdn_chunk"), ("chunk_fwd", "gdn_chunk"), ("solve_tril", "gdn_chunk"),
            ("recompute_w_u", "gdn_chunk"), ("kkt", "gdn_chunk"), ("l2norm", "gdn_chunk"),
            ("chunk_local_cumsum", "gdn_chunk"), ("gdn_recurrent", "gdn_chunk"), ("causal_conv", "conv"),
            ("gdn_gates", "gdn_gates"), ("kv_write", "kv_write"),
            ("attn", "attention"), ("flash", "attention"), ("fmha", "attention"), ("attention", "attention"),
            ("gemm", "linear_gemm"), ("gemv", "linear_gemm"), ("nvjet", "linear_gemm"), ("cutlass", "linear_gemm"),
            ("xmma", "linear_gemm"), ("aten::mm", "linear_gemm"), ("aten::addmm", "linear_gemm"),
            ("aten::matmul", "linear_gemm"), ("aten::linear", "linear_gemm"),
            ("rmsnorm", "norms"), ("norm", "norms"), ("rope", "rope"), ("rotary", "rope"),
            ("silu", "elementwise_copies"), ("sigmoid", "elementwise_copies"))


def is_copy(name: str) -> bool:
    low = name.lower()
    return any(p in low for p in _COPY)


def category(name: str, op: str | None) -> str:
    """The category of one kernel given the ops method that launched it (None: model glue code)."""
    low = name.lower()
    if op == "linear":
        return "dequant" if "dequant" in low else "elementwise_copies" if is_copy(name) else "linear_gemm"
    if op in _COMPOSITE:
        base, inner = _COMPOSITE[op]
        return next((cat for key, cat in inner if key in low), "elementwise_copies" if is_copy(name) else base)
    if op in _OP_CATEGORY:
        base = _OP_CATEGORY[op]
        return "elementwise_copies" if base not in ("embedding", "kv_write") and is_copy(name) else base
    for key, cat in _BY_NAME:
        if key in low:
            return cat
    return "elementwise_copies" if is_copy(name) else "other"


def layer_type(section: str | None) -> str:
    if section is None:
        return "unattributed"
    if section.startswith("layer:"):
        return section.rsplit(":", 1)[1]
    return section


class _Finder:
    """Which of a set of non-overlapping (label, start, end) ranges holds a time point."""

    def __init__(self, ranges):
        self.ranges = sorted(ranges, key=lambda r: r[1])
        self.starts = [r[1] for r in self.ranges]

    def find(self, t: float) -> str | None:
        i = bisect.bisect_right(self.starts, t) - 1
        if i >= 0 and t <= self.ranges[i][2]:
            return self.ranges[i][0]
        return None


def attribute(kernels, sections, op_ranges) -> list[dict]:
    """One row per kernel: name, us, section, layer type, op, category. A kernel whose execution falls in no
    section (device and host clocks apart) is placed by the host time of its launch, when known."""
    secs, ops = _Finder(sections), _Finder(op_ranges)
    rows = []
    for name, start, dur, *launch in kernels:
        t = start + dur / 2
        if secs.find(t) is None and launch and launch[0] is not None:
            t = launch[0]
        sec, op = secs.find(t), ops.find(t)
        rows.append({"name": name, "us": float(dur), "section": sec, "type": layer_type(sec), "op": op,
                     "category": category(name, op)})
    return rows


def _table(rows, key) -> dict:
    out: dict = defaultdict(lambda: defaultdict(float))
    for r in rows:
        out[r[key]][r["type"]] += r["us"]
    return {k: dict(v) for k, v in out.items()}


def scales(counts: dict, target: dict) -> dict:
    """Per layer type, how many times the measured layers must be repeated to reach the target model."""
    s = {t: 1.0 for t in TYPES}
    for t in ("gdn", "attn"):
        s[t] = target.get(t, 0) / counts[t] if counts.get(t) else 0.0
    return s


def extrapolate(by_type: dict, sc: dict) -> float:
    return sum(us * sc.get(t, 1.0) for t, us in by_type.items())


def summarize(rows, counts: dict, target: dict, top: int = 25) -> dict:
    """Tables of one profiled prefill: by category, by op and by layer type (us, measured and extrapolated),
    and the top kernels by time."""
    sc = scales(counts, target)
    total = sum(r["us"] for r in rows)
    by_type: dict = defaultdict(float)
    for r in rows:
        by_type[r["type"]] += r["us"]
    kern: dict = {}
    for r in rows:
        k = kern.setdefault((r["name"], r["category"]), {"name": r["name"], "us": 0.0, "calls": 0,
                                                         "category": r["category"], "ops": set()})
        k["us"] += r["us"]
        k["calls"] += 1
        k["ops"].add(r["op"] or "-")
    ranked = sorted(kern.values(), key=lambda k: -k["us"])[:top]
    for k in ranked:
        k["ops"] = ",".join(sorted(k["ops"]))

    def rowset(table):
        out = []
        for name, per in table.items():
            us = sum(per.values())
            out.append({"name": name, "us": us, "pct": 100 * us / total if total else 0.0, "by_type": per,
                        "per_gdn_layer_us": per.get("gdn", 0.0) / counts["gdn"] if counts.get("gdn") else 0.0,
                        "per_attn_layer_us": per.get("attn", 0.0) / counts["attn"] if counts.get("attn") else 0.0,
                        "extrapolated_us": extrapolate(per, sc)})
        return sorted(out, key=lambda r: -r["us"])
    return {"total_us": total, "extrapolated_total_us": extrapolate(by_type, sc), "scales": sc,
            "by_type": dict(by_type), "categories": rowset(_table(rows, "category")),
            "ops": rowset(_table([{**r, "op": r["op"] or "(model)"} for r in rows], "op")), "top": ranked}


def section_totals(marks) -> dict:
    """Wall time per layer type from consecutive section marks [(label, seconds)] ending in ("end", t)."""
    out: dict = defaultdict(float)
    for (label, t0), (_, t1) in zip(marks, marks[1:]):
        if label != "end":
            out[layer_type(label)] += t1 - t0
    return dict(out)


def extrapolated_wall(by_type_s: dict, counts: dict, target: dict) -> float:
    return extrapolate(by_type_s, scales(counts, target))
