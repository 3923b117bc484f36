"""A Hugging Face Qwen3.8 checkpoint (local folder or Hub repo id), checked completely before any work.

`open_source` reads only safetensors headers and small JSON files: it builds the ModelConfig, matches
every tensor against the inventory the config implies (missing, extra, misshaped, unsupported dtype ->
SourceError naming it) and collects the resources, checked as the runtime will read them (`hf_resources`:
the tokenizer loads, the chat template compiles). Headers are parsed by `safe_open` (a corrupt one is a
SourceError naming the file); tensor data is read later, lazily and by row range (`TensorReader`: plain
`pread` at the validated offsets, so nothing stays mapped), in whichever process needs it.
"""
from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

from ninfer_formats.errors import SourceError
from ninfer_formats.model_config import ModelConfig

from .hf_config import to_model_config
from .hf_resources import check_template, check_tokenizer, config_template
from .inventory import artifact_name, artifact_shape, expected_shapes

INDEX = "model.safetensors.index.json"
RESOURCES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
             "preprocessor_config.json", "config.json")
HUB_PATTERNS = ["*.safetensors", INDEX, *RESOURCES]
DTYPES = {"BF16": "bf16", "F16": "f16", "F32": "f32"}          # safetensors dtype -> artifact plain format
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")


@dataclass(frozen=True)
class SourceTensor:
    name: str                    # artifact name
    hf_name: str
    file: str                    # absolute path of the safetensors file
    fmt: str                     # plain format of the stored dtype: bf16 / f16 / f32
    hf_shape: tuple[int, ...]
    offset: int = 0              # absolute file offset of the data (from the validated header)

    @property
    def shape(self) -> tuple[int, ...]:
        return artifact_shape(self.name, self.hf_shape)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.hf_shape, dtype=np.int64)) * (4 if self.fmt == "f32" else 2)


@dataclass(frozen=True)
class HFSource:
    root: Path
    label: str                               # "owner/name@commit" or the folder name (informative)
    config: ModelConfig
    hf_config: dict
    tensors: dict                            # artifact name -> SourceTensor, in inventory order
    resources: dict                          # resource name -> bytes
    fingerprint: str                         # headers + sizes + config: changes when the source does


def resolve(source: str) -> tuple[Path, str]:
    """Local folder, or `owner/name[@revision]` fetched with only the files the packer needs."""
    p = Path(source).expanduser()
    if p.is_dir():
        return p.resolve(), p.resolve().name
    if p.exists():
        raise SourceError(f"{source}: not a folder (expected a checkpoint folder or a Hub repo id)")
    if not _REPO_ID.match(source):
        raise SourceError(f"{source}: no such folder, and not a Hub repo id of the form owner/name[@revision]")
    repo, _, rev = source.partition("@")
    from huggingface_hub import snapshot_download
    try:
        path = Path(snapshot_download(repo_id=repo, revision=rev or None, allow_patterns=HUB_PATTERNS))
    except Exception as e:  # hub errors are many types; all mean "cannot get this source"
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SourceError(f"{source}: cannot download from the Hugging Face Hub: {first}") from None
    return path, f"{repo}@{path.name}"


def _not_a_dir(path: Path) -> None:
    # is_file() is False for a folder too; "missing" would send the user looking for the wrong problem
    if path.is_dir():
        raise SourceError(f"{path}: is a directory, expected a file")


def _load_json(path: Path, required: bool) -> dict | None:
    _not_a_dir(path)
    if not path.is_file():
        if required:
            raise SourceError(f"{path}: missing (every HF checkpoint folder has a config.json)")
        return None
    try:
        d = json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError) as e:
        raise SourceError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise SourceError(f"{path}: not a JSON object")
    return d


def _shard_files(root: Path) -> list[Path]:
    index = _load_json(root / INDEX, required=False)
    if index is None:
        files = sorted(root.glob("*.safetensors"))
        for f in files:
            _not_a_dir(f)
        if not files:
            raise SourceError(f"{root}: no *.safetensors files")
        return files
    wm = index.get("weight_map")
    if not isinstance(wm, dict) or not wm:
        raise SourceError(f"{root / INDEX}: weight_map is missing or empty")
    for k, v in wm.items():
        # values are shard file names next to the index; anything else would be hashed/joined as a path
        if not isinstance(v, str) or not v or Path(v).is_absolute() or ".." in Path(v).parts:
            raise SourceError(f"{root / INDEX}: weight_map[{json.dumps(k)}]: expected a file name in the "
                              f"checkpoint folder, got {v!r:.40}")
    files = [root / f for f in sorted(set(wm.values()))]
    for f in files:
        _not_a_dir(f)
        if not f.is_file():
            raise SourceError(f"{f}: listed in {INDEX} but missing")
    return files


def _data_offsets(path: Path) -> dict[str, int]:
    """Absolute data offset per tensor. Called only after safe_open accepted the header, which checks
    the offsets tile the buffer exactly, so the raw JSON can be trusted here."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    return {k: 8 + n + v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"}


def read_header(path: Path) -> dict[str, tuple[str, tuple[int, ...], int]]:
    """{hf name: (safetensors dtype, shape, data offset)}; a corrupt file is a SourceError naming it."""
    from safetensors import safe_open
    try:
        with safe_open(str(path), framework="pt") as f:
            out = {}
            for k in f.keys():
                sl = f.get_slice(k)
                out[k] = (sl.get_dtype(), tuple(int(d) for d in sl.get_shape()))
        offsets = _data_offsets(path)
        return {k: (dt, shape, offsets[k]) for k, (dt, shape) in out.items()}
    except Exception as e:  # SafetensorError and friends: the header cannot be trusted
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SourceError(f"{path}: corrupt safetensors header ({first})") from None


def _scan(files: list[Path]) -> dict[str, tuple]:
    """artifact name -> (hf name, file, dtype, shape, offset) over all shards; unknown names are errors."""
    found: dict[str, tuple] = {}
    for f in files:
        for hf_name, (dtype, shape, offset) in read_header(f).items():
            name = artifact_name(hf_name)
            if name is None:
                raise SourceError(f"{f}: unexpected tensor {hf_name} (not part of a Qwen3.8 checkpoint)")
            if name in found:
                raise SourceError(f"{f}: tensor {hf_name} also appears as {found[name][0]} in "
                                  f"{Path(found[name][1]).name}")
            found[name] = (hf_name, str(f), dtype, shape, offset)
    return found


def _match(found: dict, expected: dict, skip: tuple[str, ...], where: str) -> dict[str, SourceTensor]:
    for name, (hf_name, f, *_) in found.items():
        if name not in expected and not name.startswith(skip):
            raise SourceError(f"{f}: unexpected tensor {hf_name} (the config implies no such tensor)")
    out = {}
    for name, shape in expected.items():
        if name not in found:
            raise SourceError(f"{where}: missing tensor {name} (in no *.safetensors file)")
        hf_name, f, dtype, got, offset = found[name]
        if got != shape:
            raise SourceError(f"{f}: tensor {hf_name} has shape {list(got)}, config.json implies {list(shape)}")
        if dtype not in DTYPES:
            raise SourceError(f"{f}: tensor {hf_name} has dtype {dtype}; supported: {', '.join(DTYPES)}")
        out[name] = SourceTensor(name, hf_name, f, DTYPES[dtype], shape, offset)
    return out


def _resources(root: Path) -> dict[str, bytes]:
    """The resource files, each checked as the runtime will read it (see hf_resources)."""
    for n in RESOURCES:
        _not_a_dir(root / n)
    out = {n: (root / n).read_bytes() for n in RESOURCES if (root / n).is_file()}
    check_tokenizer(out.get("tokenizer.json"), str(root / "tokenizer.json"))
    _load_json(root / "preprocessor_config.json", required=False)      # the vision runtime reads it as JSON
    tc_path = root / "tokenizer_config.json"
    tpl = config_template((_load_json(tc_path, required=False) or {}).get("chat_template"), str(tc_path))
    if "chat_template.jinja" in out:                   # the runtime prefers this file over tokenizer_config's
        check_template(out["chat_template.jinja"], str(root / "chat_template.jinja"))
    elif tpl is not None:
        out["chat_template.jinja"] = check_template(tpl, f"{tc_path}: chat_template").encode("utf-8")
    return dict(sorted(out.items()))


def _fingerprint(files: list[Path], tensors: dict[str, SourceTensor], cfg_bytes: bytes) -> str:
    h = xxhash.xxh3_128(cfg_bytes)
    for f in files:
        # no mtime: a touched source must still resume (the state records mtimes; see convert._check_source)
        h.update(f"{f.name}:{f.stat().st_size}\n".encode())
    for t in tensors.values():
        h.update(f"{t.name}:{t.hf_name}:{t.fmt}:{t.hf_shape}\n".encode())
    return h.hexdigest()


def open_source(source: str, *, vision: bool = True, mtp: bool = True) -> HFSource:
    """Resolve, read the config and all headers, and validate the whole inventory (no tensor data read)."""
    root, label = resolve(source)
    cfg_path = root / "config.json"
    hf = _load_json(cfg_path, required=True)
    gen = _load_json(root / "generation_config.json", required=False)
    files = _shard_files(root)
    found = _scan(files)
    has_mtp = mtp and any(n.startswith("mtp.") for n in found)
    text = hf.get("text_config", hf) if isinstance(hf.get("text_config"), dict) else hf
    if mtp and not has_mtp and text.get("mtp_num_hidden_layers"):
        # transformers drops mtp.* when it re-saves a model, but keeps the config field
        logging.getLogger("ninfer_pack").warning(
            "%s: config declares mtp_num_hidden_layers=%s but no mtp.* tensors exist; packing without MTP",
            cfg_path, text.get("mtp_num_hidden_layers"))
    has_vision = vision and any(n.startswith("visual.") for n in found)
    config = to_model_config(hf, gen, mtp=has_mtp, vision=has_vision, where=str(cfg_path))
    skip = tuple(p for p, keep in (("mtp.", has_mtp), ("visual.", has_vision)) if not keep)
    tensors = _match(found, expected_shapes(config), skip, str(root))
    return HFSource(root, label, config, hf, tensors, _resources(root),
                    _fingerprint(files, tensors, cfg_path.read_bytes()))


_NP = {"bf16": "<u2", "f16": "<f2", "f32": "<f4"}     # bf16 travels as its uint16 bits


class TensorReader:
    """Row-range reads of one source tensor with pread: no mmap, so nothing stays resident after a chunk."""

    def __init__(self, t: SourceTensor):
        self.t = t
        self.dtype = np.dtype(_NP[t.fmt])
        self.row_bytes = int(np.prod(t.shape[1:], dtype=np.int64)) * self.dtype.itemsize
        self._fd = os.open(t.file, os.O_RDONLY)

    def rows(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Rows [start, stop) in the artifact shape, as stored: bf16 as uint16 bits, f16, f32."""
        t = self.t
        stop = (t.hf_shape[0] if t.hf_shape else 1) if stop is None else stop
        want, pos = (stop - start) * self.row_bytes, t.offset + start * self.row_bytes
        buf = bytearray(want)
        view, got = memoryview(buf), 0
        while got < want:
            n = os.preadv(self._fd, [view[got:]], pos + got)
            if n <= 0:
                raise SourceError(f"{t.file}: tensor {t.hf_name} is truncated (file changed while packing?)")
            got += n
        a = np.frombuffer(buf, dtype=self.dtype)
        return a.reshape((stop - start,) + t.shape[1:]) if t.hf_shape else a.reshape(())

    def close(self) -> None:
        os.close(self._fd)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def read_rows(t: SourceTensor, start: int = 0, stop: int | None = None) -> np.ndarray:
    with TensorReader(t) as r:
        return r.rows(start, stop)


def to_f32(a: np.ndarray) -> np.ndarray:
    """Source values widened exactly to float32 (bf16 bits arrive as uint16)."""
    from ninfer_formats.codecs import bf16_to_f32
    return bf16_to_f32(a) if a.dtype == np.uint16 else a.astype(np.float32, copy=False)
