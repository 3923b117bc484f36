"""Load one rank of a `.ninfer` artifact: pick the file, verify it, check the TP set, bind the inventory
against the config, and place the weights on the device.

Weights come straight from the file mapping: `torch.frombuffer` over the mmap view, then one `.to(device)`
(and a cast to the activation dtype where needed) — no intermediate host copy. On CPU a tensor already in
the activation dtype stays a view of the mapping, so `LoadedModel` keeps the artifact open.
Linear weights (the layers' `*_proj*.weight`, `mtp.fc.weight`, `lm_head.weight`) become `QWeight`s in their stored
format; a quantized embedding table too. 1-D tensors (norm gains, A_log, dt_bias) and the conv taps stay
fp32; other plain tensors take `dtype`.
The vision tower's `visual.*` tensors are verified and inventory-checked like the rest but stay in the file
unless `vision=True` (or a later `LoadedModel.bind_vision()`): a text-only runtime never holds them.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field

import torch

from ninfer_formats.constants import PARTIAL_SUFFIX, QUANTIZED, SUFFIX
from ninfer_formats.errors import LoadError, NinferError
from ninfer_formats.model_config import ModelConfig

from . import inventory
from .weights import from_encoded, plain_tensor

ACT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
VISION_PREFIX = "visual."
_RANK_FILE = re.compile(r"(?P<stem>.+)\.tp(?P<n>[1-9][0-9]*)-rank(?P<r>0|[1-9][0-9]*)" + re.escape(SUFFIX))
_LINEAR = re.compile(r"(layers|mtp\.layers)\.\d+\..*_proj(_\w+)?\.weight|mtp\.fc\.weight|lm_head\.weight")


@dataclass
class LoadedModel:
    config: ModelConfig
    weights: dict
    resources: dict[str, bytes]
    identity: dict
    path: str
    rank: int
    tp_size: int
    artifact: object = field(default=None, repr=False)
    device: torch.device | str = "cpu"     # where load() placed the weights (bind_vision uses the same)
    dtype: torch.dtype = torch.float32

    @property
    def tokenizer(self) -> str | None:
        """tokenizer.json text (None if the artifact has none)."""
        raw = self.resources.get("tokenizer.json")
        return raw.decode("utf-8") if raw is not None else None

    @property
    def chat_template(self) -> str | None:
        if "chat_template.jinja" in self.resources:
            return self.resources["chat_template.jinja"].decode("utf-8")
        tc = self._json("tokenizer_config.json")
        return tc.get("chat_template") if isinstance(tc.get("chat_template"), str) else None

    @property
    def generation_config(self) -> dict:
        return self._json("generation_config.json")

    def _json(self, name: str) -> dict:
        if name not in self.resources:
            return {}
        try:
            out = json.loads(self.resources[name])
        except ValueError as e:
            raise LoadError(f"{self.path}: resource {name}: invalid JSON ({e})") from None
        if not isinstance(out, dict):
            raise LoadError(f"{self.path}: resource {name}: expected a JSON object")
        return out

    def bind_vision(self) -> dict:
        """Bind the artifact's `visual.*` tensors on the load device (added to `weights`; idempotent)."""
        if self.artifact is None:
            raise LoadError(f"{self.path}: the artifact is closed; cannot bind the vision tower")
        names = [n for n in self.artifact.tensors if n.startswith(VISION_PREFIX)]
        for n in names:
            if n not in self.weights:
                self.weights[n] = _bind_tensor(self.artifact, n, self.device, self.dtype)
        return {n: self.weights[n] for n in names}

    def close(self) -> None:
        """Drop the weights and the mapping (views still alive keep it until they go)."""
        self.weights = {}
        if self.artifact is not None:
            self.artifact.close()


def find_rank_file(path_or_dir, rank: int = 0, tp_size: int | None = None) -> str:
    """The rank file to open: `path_or_dir` itself, or the `{stem}.tp{N}-rank{rank}.ninfer` in a folder."""
    p = os.fspath(path_or_dir)
    if not os.path.isdir(p):
        if not os.path.exists(p):
            raise LoadError(f"{p}: no such file or folder")
        return p
    sets: dict[tuple[str, int], set[int]] = {}
    for name in sorted(os.listdir(p)):
        m = _RANK_FILE.fullmatch(name)
        if m and not name.endswith(PARTIAL_SUFFIX):
            sets.setdefault((m["stem"], int(m["n"])), set()).add(int(m["r"]))
    if tp_size is not None:
        sets = {k: v for k, v in sets.items() if k[1] == tp_size}
    if not sets:
        want = f" for TP{tp_size}" if tp_size else ""
        raise LoadError(f"{p}: no {SUFFIX} rank files{want} in this folder")
    if len(sets) > 1:
        found = ", ".join(f"{s}.tp{n}" for s, n in sorted(sets))
        raise LoadError(f"{p}: several artifacts ({found}); pass the file or --tp to choose")
    (stem, n), ranks = next(iter(sets.items()))
    if rank not in ranks:
        raise LoadError(f"{p}: rank {rank} file {stem}.tp{n}-rank{rank}{SUFFIX} is missing")
    return _rank_file(os.path.join(p, f"{stem}.tp{n}-rank{rank}{SUFFIX}"))


def _rank_file(path: str) -> str:
    """`path` if it can be a rank file: a folder under that name would fail later as a bare EISDIR."""
    if os.path.isdir(path):
        raise LoadError(f"{path}: is a directory, expected a {SUFFIX} rank file")
    return path


def _check_tp(art, path: str, rank: int, tp_size: int | None) -> None:
    from ninfer_formats.container import open_artifact
    size, mine = art.tp["size"], art.tp["rank"]
    if tp_size is not None and size != tp_size:
        raise LoadError(f"{path}: artifact is packed for TP{size}, but TP{tp_size} was requested")
    if mine != rank:
        raise LoadError(f"{path}: file is rank {mine}, but rank {rank} was requested")
    folder = os.path.dirname(path)
    for r, f in enumerate(art.tp["files"]):
        if r == mine:
            continue
        sib = os.path.join(folder, f["name"])
        if not os.path.exists(sib):
            raise LoadError(f"{path}: incomplete TP set: rank {r} file {sib} is missing")
        with open_artifact(_rank_file(sib)) as other:
            if other.artifact_id != art.artifact_id:
                raise LoadError(f"{sib}: belongs to artifact {other.artifact_id}, not {art.artifact_id} "
                                f"(mixed TP set)")


def _bind_tensor(art, name: str, device, dtype):
    e = art.tensors[name]
    raw = art.raw(name)
    if _LINEAR.fullmatch(name) or (e.fmt in QUANTIZED and len(e.shape) == 2):
        if len(e.shape) != 2:
            raise LoadError(f"{art.path}: tensor {name}: a linear weight must be 2-D, got {list(e.shape)}")
        if e.fmt == "i32":
            raise LoadError(f"{art.path}: tensor {name}: i32 cannot hold a linear weight")
        return from_encoded(e.fmt, e.shape, raw, device=device, dtype=dtype, name=name)
    if e.fmt in QUANTIZED:
        raise LoadError(f"{art.path}: tensor {name}: {e.fmt} is only supported for 2-D weights")
    keep_f32 = len(e.shape) <= 1 or name.endswith("conv1d.weight")
    return plain_tensor(e.fmt, e.shape, raw, device=device, dtype=torch.float32 if keep_f32 else dtype)


def load(path_or_dir, rank: int = 0, tp_size: int | None = None, verify: bool = True, device="cpu",
         dtype: torch.dtype = torch.float32, vision: bool = False) -> LoadedModel:
    """Open, verify (checksums; mismatch -> LoadError naming the tensor), check TP set and inventory, bind
    (`visual.*` only with `vision=True`)."""
    from ninfer_formats.container import open_artifact
    if dtype not in ACT_DTYPES:
        raise LoadError(f"dtype: {dtype} is not an activation dtype (float32, bfloat16, float16)")
    path = find_rank_file(path_or_dir, rank, tp_size)
    try:
        art = open_artifact(path)
    except NinferError as e:
        raise LoadError(str(e)) from None
    try:
        if verify:
            art.verify()
        _check_tp(art, path, rank, tp_size)
        inventory.bind({n: tuple(e.shape) for n, e in art.tensors.items()}, art.config, art.tp["size"],
                       where=path)
        weights = {n: _bind_tensor(art, n, device, dtype) for n in art.tensors
                   if vision or not n.startswith(VISION_PREFIX)}
        resources = {n: art.resource(n) for n in art.resources}
    except NinferError as e:
        art.close()
        raise (e if isinstance(e, LoadError) else LoadError(str(e))) from None
    except BaseException:
        art.close()
        raise
    return LoadedModel(art.config, weights, resources, dict(art.identity), path, rank, art.tp["size"], art,
                       torch.device(device), dtype)
