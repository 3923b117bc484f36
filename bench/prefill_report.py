"""Records and tables of bench/prefill_profile.py (from prefill_breakdown's summary and the timings)."""
from __future__ import annotations

import importlib
import os


def _versions() -> dict:
    out = {}
    for mod in ("torch", "triton", "fla"):
        try:
            out[mod] = getattr(importlib.import_module(mod), "__version__", "?")
        except Exception:                       # noqa: BLE001 - absent or broken: report it as such
            out[mod] = None
    return out


def gdn_impl(ops) -> str:
    """Which chunked delta rule the prefill ran, as the backend reports it after the warm-up prefill
    (TritonOps.gdn_prefill_impl: "fla" / "recurrent", None when no CUDA prefill has chosen, e.g. on CPU)."""
    if getattr(ops, "name", "") != "triton":
        return "torch reference (chunked, fp32)"
    if getattr(ops, "gdn_prefill_impl", lambda: None)() == "fla":
        return "fla chunk_gated_delta_rule"
    return "triton gdn_recurrent (token by token over the chunk)"


def attention_flops(hq: int, d: int, tokens: int, chunk: int) -> float:
    """QK^T and PV of causal attention in one layer over a prompt fed in chunks."""
    total = 0.0
    for a in range(0, tokens, chunk):
        t = min(tokens, a + chunk) - a
        total += 4.0 * hq * d * t * (a + (t + 1) / 2)
    return total


def _ms(d: dict) -> dict:
    return {k: v / 1e3 for k, v in d.items()}


def _row(kind: str, r: dict, ext_total: float) -> dict:
    return {"kind": kind, "name": r["name"], "ms": r["us"] / 1e3, "pct": r["pct"], "by_type_ms": _ms(r["by_type"]),
            "per_gdn_layer_ms": r["per_gdn_layer_us"] / 1e3, "per_attn_layer_ms": r["per_attn_layer_us"] / 1e3,
            "extrapolated_ms": r["extrapolated_us"] / 1e3,
            "extrapolated_pct": 100 * r["extrapolated_us"] / ext_total if ext_total else 0.0}


def records(base: dict, run, counts: dict, target: dict, ceiling: float, warm_s: float, best_s: float,
            wall: dict, summary: dict, params: dict) -> list[dict]:
    from prefill_breakdown import extrapolated_wall
    from ninfer_kernels import dispatch
    m, tokens = run.model, base["tokens"]
    cfg = m.cfg
    ext_s = extrapolated_wall(wall, counts, target)
    lin = 2.0 * tokens * sum(params.get(t, 0) * counts[t] for t in ("gdn", "attn"))
    lin_t = 2.0 * tokens * sum(params.get(t, 0) * target[t] for t in ("gdn", "attn"))
    cats = {r["name"]: r for r in summary["categories"]}
    gemm_s = cats["linear_gemm"]["us"] / 1e6 if "linear_gemm" in cats else 0.0
    attn_us = cats["attention"]["per_attn_layer_us"] if "attention" in cats else 0.0
    afl = attention_flops(cfg.num_attention_heads, cfg.head_dim, tokens, base["chunk"])
    config = {**base, "kind": "config", "layers": cfg.num_hidden_layers, "counts": counts, "target": target,
              "hidden": cfg.hidden_size, "intermediate": cfg.intermediate_size, "vocab": cfg.vocab_size,
              "gdn_impl": gdn_impl(run.ops),
              "prefill_paths": {str(k): v for k, v in dispatch.prefill_choices().items()},
              # raw values: NINFER_WITH_FLA unset means fla on (bench/device_env.sh); gdn_impl says what ran
              "env": {k: os.environ.get(k) for k in ("NINFER_GEMV_TUNE", "NINFER_WITH_FLA", "NINFER_PREFILL_PATH",
                                                      "NINFER_PREFILL_ATTN")},
              "versions": _versions(), "load_s": run.load_s, "warmup_s": warm_s, "matmul_tflops": ceiling}
    prefill = {**base, "kind": "prefill", "s": best_s, "tok_s": tokens / best_s, "extrapolated_s": ext_s,
               "extrapolated_tok_s": tokens / ext_s if ext_s else None, "target_layers": sum(target.values()),
               "linear_tflop": lin / 1e12, "linear_tflop_target": lin_t / 1e12,
               "linear_s_at_ceiling_target": lin_t / (ceiling * 1e12),
               "linear_gemm_tflops": lin / gemm_s / 1e12 if gemm_s else None,
               "linear_gemm_pct_ceiling": 100 * lin / gemm_s / 1e12 / ceiling if gemm_s else None,
               "attention_tflops": afl / (attn_us / 1e6) / 1e12 if attn_us else None,
               "kernel_ms": summary["total_us"] / 1e3, "extrapolated_kernel_ms": summary["extrapolated_total_us"] / 1e3}
    out = [config, prefill]
    sc = summary["scales"]
    for t in ("setup", "embed", "gdn", "attn", "head", "unattributed"):
        if t in wall or t in summary["by_type"]:
            w, k = wall.get(t, 0.0), summary["by_type"].get(t, 0.0) / 1e3
            out.append({"kind": "layer_type", "type": t, "count": counts.get(t), "target_count": target.get(t),
                        "wall_ms": 1e3 * w, "kernel_ms": k, "extrapolated_wall_ms": 1e3 * w * sc.get(t, 1.0),
                        "extrapolated_kernel_ms": k * sc.get(t, 1.0)})
    ext_total = summary["extrapolated_total_us"]
    out += [_row("category", r, ext_total) for r in summary["categories"]]
    out += [_row("op", r, ext_total) for r in summary["ops"]]
    out += [{"kind": "kernel", "rank": i + 1, "name": k["name"], "ms": k["us"] / 1e3, "calls": k["calls"],
             "category": k["category"], "ops": k["ops"]} for i, k in enumerate(summary["top"])]
    return out


def _f(v, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def render(records: list[dict], goal: float) -> str:
    cfg = next(r for r in records if r["kind"] == "config")
    pf = next(r for r in records if r["kind"] == "prefill")
    c, t = cfg["counts"], cfg["target"]
    lines = [f"prefill of {pf['tokens']} tokens (chunk {pf['chunk']}) on {cfg['device']}, {cfg['recipe']}, "
             f"{cfg['dtype']}, {cfg['backend']}; {cfg['layers']} layers = {c['gdn']} GDN + {c['attn']} attention",
             f"GDN chunk: {cfg['gdn_impl']}; prefill linear paths: "
             f"{sorted(set(cfg['prefill_paths'].values())) or '-'}; load {cfg['load_s']:.1f} s, "
             f"warm-up prefill {cfg['warmup_s']:.1f} s; {cfg['dtype']} matmul ceiling "
             f"{cfg['matmul_tflops']:.3g} TFLOP/s",
             f"measured:     {pf['s'] * 1e3:8.1f} ms = {pf['tok_s']:8.0f} tok/s",
             f"extrapolated: {pf['extrapolated_s'] * 1e3:8.1f} ms = {_f(pf['extrapolated_tok_s'], '8.0f')} tok/s "
             f"at {t['gdn']} GDN + {t['attn']} attention layers (goal {goal:.0f} tok/s)",
             f"linear: {pf['linear_tflop_target']:.3g} TFLOP at {pf['target_layers']} layers = "
             f"{pf['linear_s_at_ceiling_target'] * 1e3:.0f} ms at the ceiling; GEMMs ran at "
             f"{_f(pf['linear_gemm_tflops'], '.3g')} TFLOP/s ({_f(pf['linear_gemm_pct_ceiling'], '.0f')} % of it); "
             f"attention {_f(pf['attention_tflops'], '.3g')} TFLOP/s", "",
             "layer type   count  wall ms  kernel ms  -> count  wall ms  kernel ms"]
    for r in records:
        if r["kind"] == "layer_type":
            lines.append(f"{r['type']:<12} {_f(r['count'], 'd') if r['count'] is not None else '-':>5} "
                         f"{r['wall_ms']:8.1f} {r['kernel_ms']:10.1f}    {r['target_count'] or '-':>5} "
                         f"{r['extrapolated_wall_ms']:8.1f} {r['extrapolated_kernel_ms']:10.1f}")
    for kind, title in (("category", "category"), ("op", "ops method")):
        lines += ["", f"{title:<20} {'ms':>8} {'%':>5} {'/gdn layer':>10} {'/attn layer':>11} {'other':>7} "
                      f"{'x' + str(pf['target_layers']) + ' ms':>9} {'%':>5}"]
        for r in records:
            if r["kind"] == kind:
                other = sum(v for k, v in r["by_type_ms"].items() if k not in ("gdn", "attn"))
                lines.append(f"{r['name']:<20} {r['ms']:8.2f} {r['pct']:5.1f} {r['per_gdn_layer_ms']:10.3f} "
                             f"{r['per_attn_layer_ms']:11.3f} {other:7.2f} {r['extrapolated_ms']:9.1f} "
                             f"{r['extrapolated_pct']:5.1f}")
    lines += ["", f"{'#':>3} {'ms':>8} {'calls':>5}  {'category':<18} {'ops':<22} kernel"]
    for r in records:
        if r["kind"] == "kernel":
            lines.append(f"{r['rank']:>3} {r['ms']:8.2f} {r['calls']:>5}  {r['category']:<18} {r['ops'][:22]:<22} "
                         f"{r['name'][:90]}")
    return "\n".join(lines)
