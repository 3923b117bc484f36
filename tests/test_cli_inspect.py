"""`ninfer-pack inspect` / `verify`: good files report, every bad file is one `error:` line and non-zero exit."""
from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest
from click.testing import CliRunner

from container_util import META, MIXED, RESOURCES, build, edited, random_tensors, rehash_header, split, tiny_config
from ninfer_formats.constants import MAX_DIRECTORY_BYTES
from ninfer_formats.container import open_artifact, write_artifact
from ninfer_pack.cli import main


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    d = tmp_path_factory.mktemp("good")
    rng = np.random.default_rng(21)
    tp1 = write_artifact(d / "tp1", "m", tiny_config(), [random_tensors(rng)], RESOURCES, META)[0]
    tp2 = write_artifact(d / "tp2", "m", tiny_config(), [random_tensors(rng), random_tensors(rng)], RESOURCES, META)
    other = write_artifact(d / "other", "m", tiny_config(), [random_tensors(rng), random_tensors(rng)],
                           RESOURCES, META)
    return {"tp1": tp1, "tp2": tp2, "other": other, "root": d}


def _read(p) -> bytes:
    with open(p, "rb") as f:
        return f.read()


def _flip_in(path, name) -> bytes:
    data = bytearray(_read(path))
    with open_artifact(path) as a:
        e = a.tensors.get(name) or a.resources[name]
        data[a.header.payload_offset + e.offset + e.length - 1] ^= 0x80
    return bytes(data)


def _hdr(data, off, fmt, v):
    b = bytearray(data)
    struct.pack_into(fmt, b, off, v)
    return bytes(rehash_header(b))


def _set(path, value):
    def fn(d, payload):
        obj = d
        for k in path[:-1]:
            obj = obj[k]
        obj[path[-1]] = value
    return fn


EMBED = "embed_tokens.weight"
BAD = {   # name -> (make bad bytes from the good TP1 file, text the error must contain)
    "truncated": (lambda p: _read(p)[:-10], "truncated"),
    "wrong-magic": (lambda p: b"PK\x03\x04" + _read(p)[4:], "not a .ninfer file"),
    "unknown-version": (lambda p: _hdr(_read(p), 8, "<I", 7), "version 7 is not supported"),
    "oversized-directory": (lambda p: _hdr(_read(p), 16, "<Q", MAX_DIRECTORY_BYTES * 4), "exceeds the limit"),
    "malformed-directory": (lambda p: build(b'{"model": [}', split(_read(p))[1]), "invalid JSON"),
    "misaligned": (lambda p: edited(_read(p), _set(("tensors", 0, "offset"), 128)), "not a multiple of 256"),
    "overlapping": (lambda p: edited(_read(p), _set(("resources", 0, "offset"), 0)), "overlaps"),
    "out-of-bounds": (lambda p: edited(_read(p), _set(("resources", 1, "offset"), 1 << 32)), "outside the payload"),
    "shape-bytes-mismatch": (lambda p: edited(_read(p), _set(("tensors", 0, "shape"), [36, 24])), "encodes to"),
    "unknown-format": (lambda p: edited(_read(p), _set(("tensors", 0, "format"), "fp64")), "unknown format"),
    "duplicate-names": (lambda p: edited(_read(p), _set(("tensors", 2, "name"), EMBED)), "duplicate name"),
    "flipped-tensor-bit": (lambda p: _flip_in(p, "layers.0.mlp.down_proj.weight"),
                           "tensor layers.0.mlp.down_proj.weight: checksum mismatch"),
    "flipped-resource-bit": (lambda p: _flip_in(p, "tokenizer.json"), "resource tokenizer.json: checksum mismatch"),
}


def _bad_file(tmp_path, good, case) -> str:
    make, _ = BAD[case]
    p = tmp_path / "m.tp1-rank0.ninfer"
    p.write_bytes(make(good["tp1"]))
    return str(p)


def _one_error_line(stderr: str, *needles: str) -> None:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("error: ") and "Traceback" not in stderr
    for n in needles:
        assert n in lines[0], lines[0]


# ---- good files ----------------------------------------------------------------------------
def test_inspect_human(good):
    r = CliRunner().invoke(main, ["inspect", good["tp2"][1]])
    assert r.exit_code == 0, r.output
    out = r.stdout
    with open_artifact(good["tp2"][1]) as a:
        assert a.artifact_id in out
    assert "rank 1 of 2" in out and "m.tp2-rank0.ninfer" in out and "bits/w" in out
    assert all(name in out for name in MIXED) and "tokenizer.json  zstd" in out
    assert out.splitlines()[-1].startswith(f"total      {len(MIXED)} tensors")


def test_inspect_json(good):
    r = CliRunner().invoke(main, ["inspect", "--json", good["tp1"]])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    assert rep["tp"]["size"] == 1 and rep["header"]["payload_offset"] % 4096 == 0
    by_name = {t["name"]: t for t in rep["tensors"]}
    assert by_name["layers.0.mlp.down_proj.weight"]["bits_per_weight"] == 6.5625
    assert by_name["layers.0.self_attn.q_proj.weight"]["bits_per_weight"] == 3.4375
    assert rep["totals"]["params"] == sum(t["params"] for t in rep["tensors"])
    assert rep["totals"]["tensors"] == len(MIXED) and rep["totals"]["resources"] == len(RESOURCES)


@pytest.mark.parametrize("which", ["tp1", "tp2-folder", "tp2-one-file", "two-folders"])
def test_verify_good(good, which):
    args = {"tp1": [good["tp1"]], "tp2-folder": [str(good["root"] / "tp2")], "tp2-one-file": [good["tp2"][0]],
            "two-folders": [str(good["root"] / "tp2"), str(good["root"] / "other")]}[which]
    r = CliRunner().invoke(main, ["verify", *args])
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert lines and all(line.startswith("OK ") for line in lines) and r.stderr == ""
    assert len(lines) == {"tp1": 1, "tp2-folder": 2, "tp2-one-file": 2, "two-folders": 4}[which]


# ---- bad files -----------------------------------------------------------------------------
@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_verify_bad(tmp_path, good, case):
    path = _bad_file(tmp_path, good, case)
    r = CliRunner().invoke(main, ["verify", path])
    assert r.exit_code == 1, r.output
    assert r.stdout == ""
    _one_error_line(r.stderr, path, BAD[case][1])


@pytest.mark.parametrize("case", ["truncated", "unknown-version", "duplicate-names"])
def test_inspect_bad(tmp_path, good, case):
    path = _bad_file(tmp_path, good, case)
    r = CliRunner().invoke(main, ["inspect", path])
    assert r.exit_code == 2
    _one_error_line(r.stderr, path, BAD[case][1])


def test_verify_mixed_and_incomplete_sets(tmp_path, good):
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    shutil.copy(good["tp2"][0], mixed / "m.tp2-rank0.ninfer")
    shutil.copy(good["other"][1], mixed / "m.tp2-rank1.ninfer")
    r = CliRunner().invoke(main, ["verify", str(mixed)])
    assert r.exit_code == 1
    _one_error_line(r.stderr, "mixed TP set", "m.tp2-rank1.ninfer")
    r = CliRunner().invoke(main, ["verify", "--json", str(mixed)])
    rep = json.loads(r.stdout)
    assert r.exit_code == 1 and len(rep["ok"]) == 2 and "mixed TP set" in rep["problems"][0]
    os.unlink(mixed / "m.tp2-rank1.ninfer")
    r = CliRunner().invoke(main, ["verify", str(mixed / "m.tp2-rank0.ninfer")])
    assert r.exit_code == 1
    _one_error_line(r.stderr, "incomplete TP set: rank 1")


def test_verify_missing_path(tmp_path):
    r = CliRunner().invoke(main, ["verify", str(tmp_path / "absent.ninfer")])
    assert r.exit_code == 1
    _one_error_line(r.stderr, "no such file")


# ---- real processes: the entry points people run ------------------------------------------------
def _command(which: str) -> list[str]:
    if which == "module":
        return [sys.executable, "-c", "from ninfer_pack.cli import main; main()"]
    exe = shutil.which("ninfer-pack")
    assert exe, "the ninfer-pack entry point is not on PATH (pip install -e . installs it)"
    return [exe]


@pytest.mark.parametrize("which", ["module", "ninfer-pack"])
def test_subprocess_verify(tmp_path, good, which):
    cmd = _command(which)
    ok = subprocess.run(cmd + ["verify", good["tp1"]], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and ok.stdout.startswith("OK "), ok.stderr
    bad = _bad_file(tmp_path, good, "flipped-tensor-bit")
    r = subprocess.run(cmd + ["verify", bad], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and r.stdout == ""
    _one_error_line(r.stderr, bad, "layers.0.mlp.down_proj.weight")
    r = subprocess.run(cmd + ["inspect", bad[:-3]], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    _one_error_line(r.stderr)


def _renamed(tmp_path, good, names):
    """The good TP2 set copied under other names (rank order of `names` = the files' real ranks)."""
    d = tmp_path / "renamed"
    d.mkdir()
    for src, name in zip(good["tp2"], names):
        shutil.copy(src, d / name)
    return d


@pytest.mark.parametrize("names,needles", [
    (("m.tp2-rank1.ninfer", "m.tp2-rank0.ninfer"),
     ("named m.tp2-rank0.ninfer", "records itself as m.tp2-rank1.ninfer", "rank 1 of tp 2")),
    (("other.tp2-rank0.ninfer", "m.tp2-rank1.ninfer"),
     ("other.tp2-rank0.ninfer", "records itself as m.tp2-rank0.ninfer", "rank 0 of tp 2")),
], ids=["swapped-ranks", "renamed-stem"])
def test_verify_file_name_must_match_recorded_name(tmp_path, good, names, needles):
    """Checksums pass, but the runtime finds siblings by their recorded names: verify must refuse too."""
    d = _renamed(tmp_path, good, names)
    r = CliRunner().invoke(main, ["verify", str(d)])
    assert r.exit_code == 1
    _one_error_line(r.stderr, *needles)
