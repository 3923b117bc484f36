"""report.json: per tensor format, bits/weight, relative RMSE vs the source and seconds; totals per role."""
from __future__ import annotations

import math
from pathlib import Path

from ninfer_formats.constants import FORMATS
from ninfer_formats.plan import default_producer

from .out_dir import REPORT_MARKER
from .pack_plan import PackPlan, numel


def _roles(plan: PackPlan, entries: dict[str, dict]) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for j in plan.jobs:
        r = out.setdefault(j.role or "other", {"formats": set(), "params": 0, "bytes": 0, "_err": 0.0})
        n = numel(j.src.shape)
        r["formats"].add(j.fmt)
        r["params"] += n
        r["bytes"] += FORMATS[j.fmt].encoded_size(j.src.shape)
        r["_err"] += entries.get(j.name, {}).get("rel_rmse", 0.0) ** 2 * n
    for r in out.values():
        r["formats"] = sorted(r["formats"])
        r["bits_per_weight"] = round(8 * r["bytes"] / max(1, r["params"]), 4)
        r["rel_rmse"] = round(math.sqrt(r.pop("_err") / max(1, r["params"])), 6)  # param-weighted RMS
    return dict(sorted(out.items()))


def build_report(plan: PackPlan, entries: dict[str, dict], files: list[Path], artifact_id: str) -> dict:
    params = sum(numel(j.src.shape) for j in plan.jobs)
    enc = sum(FORMATS[j.fmt].encoded_size(j.src.shape) for j in plan.jobs)
    tensors = {}
    for j in plan.jobs:
        e = {k: v for k, v in entries.get(j.name, {}).items() if k != "name"}
        tensors[j.name] = e or {"format": j.fmt, "missing": "no report line (converted by an older run)"}
    return {
        REPORT_MARKER[0]: REPORT_MARKER[1],        # lets a rerun tell our report.json from the user's
        "producer": default_producer(), "source": plan.source.label, "artifact_id": artifact_id,
        "recipe": plan.recipe.describe(), "tp": plan.tp,
        "files": [{"name": f.name, "bytes": f.stat().st_size} for f in files],
        "totals": {"tensors": len(plan.jobs), "params": params, "encoded_bytes": enc,
                   "file_bytes": sum(f.stat().st_size for f in files),
                   "bits_per_weight": round(8 * enc / max(1, params), 4),
                   "seconds": round(sum(e.get("seconds", 0.0) for e in entries.values()), 3)},
        "roles": _roles(plan, entries),
        "tensors": tensors,
    }
