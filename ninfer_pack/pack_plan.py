"""Planning a conversion: every tensor's stored format and TP cut, the worker tasks, and each rank's plan.

Everything here is decided from headers and the config alone, before any tensor is read, so an illegal
recipe/TP combination fails at once with the tensor named.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ninfer_formats.constants import FORMATS, QUANTIZED
from ninfer_formats.container import ArtifactPlan, TensorSpec
from ninfer_formats.errors import SourceError

from .hf_source import HFSource, SourceTensor
from .recipes import Recipe, fusion_key, role_of
from .tp_split import Split, plan_split

STEM = "model"


@dataclass(frozen=True)
class TensorJob:
    src: SourceTensor
    fmt: str                      # stored format
    role: str | None
    split: Split

    @property
    def name(self) -> str:
        return self.src.name

    @property
    def encoded_bytes(self) -> int:
        """Bytes of the whole (TP1) encoded tensor: what a worker holds while assembling shards."""
        return FORMATS[self.fmt].encoded_size(self.src.shape)


@dataclass(frozen=True)
class Task:
    """Tensors one worker converts together: an NVFP4 fusion group (shared global scale) or one tensor."""

    jobs: tuple[TensorJob, ...]
    todo: tuple[tuple[int, ...], ...]     # per job: the ranks that still need it (resume)

    @property
    def source_bytes(self) -> int:
        return sum(j.src.nbytes for j in self.jobs)

    @property
    def cost(self) -> int:
        return max(j.encoded_bytes for j in self.jobs)


@dataclass(frozen=True)
class PackPlan:
    source: HFSource
    recipe: Recipe
    tp: int
    jobs: tuple[TensorJob, ...]           # artifact order

    def rank_plan(self, rank: int) -> ArtifactPlan:
        specs = [TensorSpec(j.name, j.split.rank_shape, j.fmt) for j in self.jobs]
        meta = {"source": self.source.label, "recipe": self.recipe.describe()}
        return ArtifactPlan(self.source.config, self.tp, rank, specs, dict(self.source.resources), meta)

    def tasks(self, done_per_rank: list[set[str]]) -> list[Task]:
        """Unfinished work, NVFP4 fusion groups kept together, largest first (memory-bounded scheduling)."""
        groups: dict[str, list[TensorJob]] = {}
        for j in self.jobs:
            key = fusion_key(j.name) if j.fmt == "nvfp4" else None
            groups.setdefault(key or j.name, []).append(j)
        out = []
        for members in groups.values():
            todo = tuple(tuple(r for r in range(self.tp) if j.name not in done_per_rank[r]) for j in members)
            if any(todo):
                out.append(Task(tuple(members), todo))
        out.sort(key=lambda t: -t.cost)
        return out


def _check_format(src: SourceTensor, fmt: str, role: str | None) -> None:
    if fmt not in QUANTIZED:
        return
    shape, spec = src.shape, FORMATS[fmt]
    hint = f"; use --override {role}=bf16" if role else ""
    if len(shape) != 2:
        raise SourceError(f"{src.name}: {fmt} needs a 2-D tensor, got shape {list(shape)}{hint}")
    if shape[1] % spec.k_multiple:
        raise SourceError(f"{src.name}: {fmt} needs K (= {shape[1]}) to be a multiple of "
                          f"{spec.k_multiple}{hint}")


def make_plan(source: HFSource, recipe: Recipe, tp: int) -> PackPlan:
    if tp < 1:
        raise SourceError(f"--tp {tp}: must be a positive integer")
    jobs = []
    for src in source.tensors.values():
        fmt, role = recipe.format_for(src.name, src.fmt), role_of(src.name)
        _check_format(src, fmt, role)
        jobs.append(TensorJob(src, fmt, role, plan_split(src.name, src.shape, source.config, tp, fmt)))
    return PackPlan(source, recipe, tp, tuple(jobs))


def numel(shape) -> int:
    return math.prod(shape)
