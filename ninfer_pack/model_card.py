"""README.md model card for an artifact folder: Hub YAML front matter, what is inside, how to serve it.

Deterministic for a given artifact (no dates, no timings), so two identical conversions give identical cards.
"""
from __future__ import annotations

import json

from .out_dir import CARD_MARKER
from .pack_plan import PackPlan


def _q(s) -> str:
    return json.dumps(str(s))          # a JSON string is a valid YAML double-quoted scalar


def _front_matter(plan: PackPlan, report: dict, base_model: str | None) -> list[str]:
    tp, rec = plan.tp, plan.recipe.name
    fmts = sorted({j.fmt for j in plan.jobs})
    lines = ["---"]
    if base_model:
        lines += [f"base_model: {_q(base_model)}", "base_model_relation: quantized"]
    lines += ["library_name: ninfer", "tags:"]
    lines += [f"- {_q(t)}" for t in ["ninfer", "qwen3_5", *fmts, "tensor-parallel" if tp > 1 else "single-gpu",
                                     f"tp{tp}"]]
    lines += [f"recipe: {_q(rec)}", f"tp_size: {tp}", f"artifact_id: {_q(report['artifact_id'])}", "sizes:",
              f"  total_bytes: {report['totals']['file_bytes']}",
              f"  params: {report['totals']['params']}",
              f"  bits_per_weight: {report['totals']['bits_per_weight']}", "  files:"]
    lines += [f"    {_q(f['name'])}: {f['bytes']}" for f in report["files"]]
    return lines + ["---", "", CARD_MARKER, ""]       # the marker: a rerun may replace this card


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def _body(plan: PackPlan, report: dict, base_model: str | None) -> list[str]:
    cfg, tp, t = plan.source.config, plan.tp, report["totals"]
    title = (base_model or plan.source.label.split("@")[0]).split("/")[-1]
    parts = ["MTP draft head" if cfg.mtp_num_hidden_layers else None,
             "vision tower" if cfg.vision is not None else None]
    extras = ", ".join(p for p in parts if p) or "text only"
    lines = [f"# {title} — ninfer `{plan.recipe.name}`, TP{tp}", "",
             f"A `.ninfer` artifact packed by `ninfer-pack convert` from `{plan.source.label}` "
             f"({cfg.num_hidden_layers} layers, {extras}). {t['tensors']} tensors, {t['params']:,} parameters, "
             f"{t['bits_per_weight']} bits/weight on average, {_gib(t['file_bytes'])} in {tp} rank file(s) "
             "pre-sharded for tensor parallelism. Every tensor and resource carries an xxh3-128 checksum; "
             "the rank files share one content-derived artifact id.", "",
             "| role | format | parameters | bits/weight | rel. RMSE vs source |", "|---|---|---:|---:|---:|"]
    for role, r in report["roles"].items():
        lines.append(f"| {role} | {', '.join(r['formats'])} | {r['params']:,} | {r['bits_per_weight']} | "
                     f"{r['rel_rmse']:.4f} |")
    lines += ["", "Norms, conv1d, A_log and dt_bias keep the checkpoint's dtype bit for bit; per-tensor "
              "numbers are in `report.json`.", "", "| file | bytes |", "|---|---:|"]
    lines += [f"| `{f['name']}` | {f['bytes']:,} |" for f in report["files"]]
    return lines


def _serve(plan: PackPlan, base_model: str | None) -> list[str]:
    tp = plan.tp
    return ["", "## Serve", "", "```bash", "pip install 'ninfer[gpu,serve]'",
            "hf download <this repo> --local-dir ./model      # or any local copy of this folder",
            f"ninfer-rt serve ./model --tp {tp}" + (f"          # one process, {tp} GPUs" if tp > 1 else ""),
            "```", "",
            f"The runtime needs exactly {tp} GPU(s) for this TP{tp} set (re-pack with `ninfer-pack convert "
            "--tp N` for another count). It checks every checksum at load and serves an OpenAI-compatible API "
            "(`/v1/chat/completions`) with MTP speculative decoding when the artifact holds the MTP head.",
            "", "## Reproduce", "", "```bash",
            f"ninfer-pack convert {base_model or plan.source.label} ./model {_recipe_args(plan)} --tp {tp}",
            "```", ""]


def _recipe_args(plan: PackPlan) -> str:
    """--recipe (+ --override for roles that differ from the built-in) that rebuild this recipe."""
    from .recipes import BUILTIN
    name, roles = plan.recipe.name, dict(plan.recipe.roles)
    if name not in BUILTIN or plan.recipe.tensor_rules:
        return f"--recipe {name}.toml   # the recipe file used: roles and rules are in report.json"
    diff = [f"--override {r}={f}" for r, f in roles.items() if BUILTIN[name].get(r) != f]
    return " ".join([f"--recipe {name}", *diff])


def render_card(plan: PackPlan, report: dict, base_model: str | None = None) -> str:
    """The README.md text; `base_model` defaults to the Hub repo id the source came from, if any."""
    if base_model is None and "@" in plan.source.label:
        base_model = plan.source.label.split("@")[0]
    return "\n".join(_front_matter(plan, report, base_model) + _body(plan, report, base_model)
                     + _serve(plan, base_model))
