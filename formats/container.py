"""The `.ninfer` v1 container API (DESIGN.md "Container"; the format itself is FORMAT.md).

Implementation lives in: header.py (64-byte header), directory.py (JSON schema, geometry, digests),
model_schema.py (the `model` member), plan.py (specs, layout), writer.py (RankWriter, finalize_set),
reader.py (open_artifact), tpset.py (verify_paths).
"""
from __future__ import annotations

import os

from .directory import ResourceEntry, TensorEntry, artifact_id, rank_file_name, shard_digest
from .model_config import ModelConfig
from .plan import ArtifactPlan, TensorSpec
from .reader import Artifact, open_artifact
from .tpset import Report, check_paths, verify_paths
from .writer import RankWriter, finalize_set

__all__ = ["ArtifactPlan", "TensorSpec", "RankWriter", "finalize_set", "write_artifact", "open_artifact",
           "Artifact", "TensorEntry", "ResourceEntry", "verify_paths", "check_paths", "Report",
           "rank_file_name", "shard_digest", "artifact_id"]


def write_artifact(dir, stem: str, config: ModelConfig, ranks: list[dict], resources: dict | None = None,
                   meta: dict | None = None) -> list[str]:
    """Write a whole TP set at once. `ranks[r]` = {name: (fmt, shape, data_u8)}; resources go to every rank."""
    os.makedirs(dir, exist_ok=True)
    n, writers = len(ranks), []
    try:
        for r, tensors in enumerate(ranks):
            specs = [TensorSpec(name, tuple(shape), fmt) for name, (fmt, shape, _) in tensors.items()]
            plan = ArtifactPlan(config, n, r, specs, dict(resources or {}), dict(meta or {}))
            w = RankWriter(os.path.join(os.fspath(dir), rank_file_name(stem, n, r)), plan)
            writers.append(w)
            for name, (_, _, data) in tensors.items():
                w.write(name, data)
        return finalize_set(writers)
    finally:
        for w in writers:
            w.close()
