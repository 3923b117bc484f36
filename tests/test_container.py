"""The .ninfer v1 container: round trips, zero-copy views, determinism, resume, and every malformed input."""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import struct
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from container_util import (META, MIXED, RESOURCES, build, edited, random_tensors, rehash_header, split,
                            tiny_config)
from ninfer_formats.constants import MAX_DIRECTORY_BYTES, QUANTIZED
from ninfer_formats.container import (ArtifactPlan, RankWriter, TensorSpec, finalize_set, open_artifact,
                                      verify_paths, write_artifact)
from ninfer_formats.errors import ChecksumError, FormatError, NinferError


@pytest.fixture(scope="module")
def tensors():
    return random_tensors(np.random.default_rng(7))


@pytest.fixture
def tp1(tmp_path, tensors):
    return write_artifact(tmp_path, "tiny", tiny_config(), [tensors], RESOURCES, META)[0]


def _read(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _mm_base(a) -> int:
    return np.frombuffer(a._mm, np.uint8).ctypes.data


# ---- round trips --------------------------------------------------------------------------
def test_tp1_round_trip_all_formats(tp1, tensors):
    with open_artifact(tp1, verify=True) as a:
        assert a.config == tiny_config() and a.identity["source"] == META["source"]
        assert a.tp["size"] == 1 and a.tp["files"][0]["name"] == "tiny.tp1-rank0.ninfer"
        assert [t.name for t in a.directory.tensors] == list(MIXED)          # the plan's order
        for name, (fmt, shape, data) in tensors.items():
            e = a.tensors[name]
            assert (e.fmt, e.shape, e.length) == (fmt, shape, data.size)
            assert np.array_equal(a.raw(name), data)
            if fmt not in QUANTIZED:
                assert a.array(name).shape == shape
                assert a.array(name).tobytes() == data.tobytes()
        for name, raw in RESOURCES.items():
            assert a.resource(name) == raw
        assert a.resources["tokenizer.json"].encoding == "zstd"
        assert a.resources["chat_template.jinja"].encoding == "raw"


def test_views_are_zero_copy_and_read_only(tp1):
    import torch
    with open_artifact(tp1) as a:
        base = a.header.payload_offset + _mm_base(a)
        e = a.tensors["embed_tokens.weight"]
        r, arr, t = a.raw(e.name), a.array(e.name), a.torch(e.name)
        assert r.ctypes.data == arr.ctypes.data == t.data_ptr() == base + e.offset
        assert arr.dtype == np.uint16 and t.dtype == torch.bfloat16 and tuple(t.shape) == e.shape
        assert np.array_equal(t.view(torch.int16).numpy().view(np.uint16), arr)
        assert not r.flags.writeable and not arr.flags.writeable
        q = a.torch("layers.0.mlp.down_proj.weight")
        assert q.dtype == torch.uint8 and q.numel() == a.tensors["layers.0.mlp.down_proj.weight"].length
        assert a.torch("scalar").shape == ()
        with pytest.raises(FormatError, match="not a plain format"):
            a.array("layers.0.mlp.gate_proj.weight")
        with pytest.raises(FormatError, match="no tensor named 'nope'"):
            a.raw("nope")
        kept = a.raw("layers.0.mlp.down_proj.weight")
        expect = kept.copy()
    assert np.array_equal(kept, expect)          # a view outlives close(): the mapping stays until it dies
    with pytest.raises(FormatError, match="closed"):
        a.raw("scalar")


def test_tp2_set_round_trip_and_verify(tmp_path):
    rng = np.random.default_rng(3)
    ranks = [random_tensors(rng), random_tensors(rng)]
    paths = write_artifact(tmp_path, "m", tiny_config(), ranks, RESOURCES, META)
    assert [os.path.basename(p) for p in paths] == ["m.tp2-rank0.ninfer", "m.tp2-rank1.ninfer"]
    arts = [open_artifact(p, verify=True) for p in paths]
    assert arts[0].artifact_id == arts[1].artifact_id and arts[0].tp["files"] == arts[1].tp["files"]
    for r, a in enumerate(arts):
        assert a.tp["rank"] == r
        assert all(np.array_equal(a.raw(n), d) for n, (_, _, d) in ranks[r].items())
        a.close()
    assert sorted(os.listdir(tmp_path)) == ["m.tp2-rank0.ninfer", "m.tp2-rank1.ninfer"]   # no leftovers
    assert verify_paths([tmp_path]) == [] and verify_paths([paths[1]]) == []


def test_deterministic(tmp_path, tensors):
    a = write_artifact(tmp_path / "a", "m", tiny_config(), [tensors], RESOURCES, META)[0]
    b = write_artifact(tmp_path / "b", "m", tiny_config(), [tensors], RESOURCES, META)[0]
    assert _read(a) == _read(b)


def test_layout_alignment(tp1):
    with open_artifact(tp1) as a:
        assert a.header.payload_offset % 4096 == 0
        assert all(e.offset % 256 == 0 for e in [*a.tensors.values(), *a.resources.values()])


# ---- writer: resume, workers, misuse --------------------------------------------------------
def _plan(tensors, **kw):
    specs = [TensorSpec(n, s, f) for n, (f, s, _) in tensors.items()]
    return ArtifactPlan(tiny_config(), kw.get("tp", 1), kw.get("rank", 0), specs, RESOURCES, META)


def test_resume_after_kill_gives_identical_bytes(tmp_path, tensors):
    ref = write_artifact(tmp_path / "ref", "m", tiny_config(), [tensors], RESOURCES, META)[0]
    path = str(tmp_path / "m.tp1-rank0.ninfer")
    names = list(tensors)
    w = RankWriter(path, _plan(tensors))
    for n in names[:5]:
        w.write(n, tensors[n][2])
    del w                                                  # "SIGKILL": no finalize, no cleanup
    with open(path + ".partial.journal", "ab") as j:
        j.write(b'{"name": "torn')                          # a record cut mid-write
    w = RankWriter(path, _plan(tensors))
    assert w.done() == set(names[:5])
    # a journaled tensor whose bytes were damaged is not "done"
    off = w.payload_offset + w._tensors[names[1]].offset
    with open(w.partial, "r+b") as f:
        f.seek(off)
        f.write(b"\xff\x00\xff")
    assert w.done() == set(names[:5]) - {names[1]}
    for n in names:
        if n not in w.done():
            w.write(n, tensors[n][2])
    assert finalize_set([w]) == [path]
    assert _read(path) == _read(ref)
    assert not os.path.exists(path + ".partial") and not os.path.exists(path + ".partial.journal")


def test_ctrl_c_while_resume_rehashes_is_a_keyboard_interrupt(tmp_path, tensors, monkeypatch):
    """Ctrl-C inside the re-hash of journaled tensors propagates as KeyboardInterrupt (exit 130 in the CLIs),
    not as BufferError from closing an mmap that a slice in the traceback still exports."""
    from ninfer_formats import writer as writer_mod
    path = str(tmp_path / "m.tp1-rank0.ninfer")
    w = RankWriter(path, _plan(tensors))
    for n in list(tensors)[:3]:
        w.write(n, tensors[n][2])

    def interrupted(data):
        raise KeyboardInterrupt
    monkeypatch.setattr(writer_mod, "xxh3_hex", interrupted)
    with pytest.raises(KeyboardInterrupt):
        w.done()
    monkeypatch.undo()
    assert w.done() == set(list(tensors)[:3])


def _write_then_die(path, plan, items):
    w = RankWriter(path, plan)
    for n, d in items:
        w.write(n, d)
    os.kill(os.getpid(), signal.SIGKILL)


def test_resume_after_real_sigkill(tmp_path, tensors):
    ref = write_artifact(tmp_path / "ref", "m", tiny_config(), [tensors], RESOURCES, META)[0]
    path = str(tmp_path / "m.tp1-rank0.ninfer")
    half = [(n, d) for n, (_, _, d) in list(tensors.items())[:4]]
    child = mp.get_context("fork").Process(target=_write_then_die, args=(path, _plan(tensors), half))
    child.start()
    child.join(60)
    assert child.exitcode == -signal.SIGKILL and not os.path.exists(path)
    w = RankWriter(path, _plan(tensors))
    assert w.done() == {n for n, _ in half}
    for n, (_, _, d) in tensors.items():
        if n not in w.done():
            w.write(n, d)
    finalize_set([w])
    assert _read(path) == _read(ref)


def test_threads_write_distinct_tensors(tmp_path, tensors):
    ref = write_artifact(tmp_path / "ref", "m", tiny_config(), [tensors], RESOURCES, META)[0]
    w = RankWriter(str(tmp_path / "m.tp1-rank0.ninfer"), _plan(tensors))
    with ThreadPoolExecutor(4) as ex:
        list(ex.map(lambda kv: w.write(kv[0], kv[1][2]), tensors.items()))
    assert _read(finalize_set([w])[0]) == _read(ref)


def test_changed_plan_restarts_from_scratch(tmp_path, tensors):
    path = str(tmp_path / "m.tp1-rank0.ninfer")
    w = RankWriter(path, _plan(tensors))
    w.write("scalar", tensors["scalar"][2])
    w.close()
    smaller = dict(list(tensors.items())[:3])
    w2 = RankWriter(path, _plan(smaller))
    assert w2.done() == set() and os.path.getsize(w2.partial) == w2.file_size


def _worker_write(args):
    w, name, data = args
    w.write(name, data)
    return name


def test_worker_processes_write_distinct_tensors(tmp_path, tensors):
    ref = write_artifact(tmp_path / "ref", "m", tiny_config(), [tensors], RESOURCES, META)[0]
    w = RankWriter(str(tmp_path / "m.tp1-rank0.ninfer"), _plan(tensors))
    with mp.get_context("fork").Pool(2) as pool:
        done = pool.map(_worker_write, [(w, n, d) for n, (_, _, d) in tensors.items()])
    assert sorted(done) == sorted(tensors) and w.done() == set(tensors)
    path = finalize_set([w])[0]
    assert _read(path) == _read(ref)


def test_writer_misuse(tmp_path, tensors):
    path = str(tmp_path / "m.tp1-rank0.ninfer")
    w = RankWriter(path, _plan(tensors))
    with pytest.raises(FormatError, match=r"tensor scalar: got 3 bytes, f32 \[\] encodes to 4"):
        w.write("scalar", b"abc")
    with pytest.raises(FormatError, match="not a tensor of this rank's plan"):
        w.write("nope", b"abcd")
    with pytest.raises(FormatError, match="tensors not written"):
        finalize_set([w])
    assert not os.path.exists(path)                                        # nothing looks complete
    with pytest.raises(FormatError, match="must be named"):
        RankWriter(str(tmp_path / "m.ninfer"), _plan(tensors))
    with pytest.raises(FormatError, match="need ranks 0..1"):
        finalize_set([RankWriter(str(tmp_path / "x.tp2-rank0.ninfer"), _plan(tensors, tp=2))])


@pytest.mark.parametrize("spec,msg", [
    (("w", (5, 40), "q6_k"), "multiple of 256"),
    (("w", (5, 40, 1), "nvfp4"), "needs rank 2"),
    (("w", (5,), "bogus"), "unknown format"),
    (("w", (0, 4), "f32"), "dims must be integers"),
    (("w", (2.0, 4), "f32"), "dims must be integers"),
    (("w", (True, 4), "f32"), "dims must be integers"),
    (("", (4,), "f32"), "tensor name"),
    (("w\n", (4,), "f32"), "printable ASCII"),
], ids=["k-multiple", "rank", "format", "zero-dim", "float-dim", "bool-dim", "empty-name", "control-char"])
def test_bad_tensor_specs(spec, msg):
    with pytest.raises(FormatError, match=msg):
        TensorSpec(*spec)


def test_numpy_integers_are_accepted():
    s = TensorSpec("w", (np.int64(3), np.int32(256)), "q6_k")
    assert s.shape == (3, 256) and type(s.shape[0]) is int and s.nbytes == 3 * 210
    assert ArtifactPlan(tiny_config(), np.int64(2), np.int64(1), [s]).rank == 1


# ---- malformed files: each one is a one-line FormatError ---------------------------------------
def _expect(tmp_path, data: bytes, match: str, *, verify=False, exc=FormatError):
    p = tmp_path / "bad.tp1-rank0.ninfer"
    p.write_bytes(data)
    with pytest.raises(exc, match=match) as ei:
        open_artifact(p, verify=verify).close()
    assert "\n" not in str(ei.value) and str(p) in str(ei.value)
    return str(ei.value)


def _header_edit(data, offset, fmt, value):
    b = bytearray(data)
    struct.pack_into(fmt, b, offset, value)
    return bytes(rehash_header(b))


FRAMING = {
    "empty": (lambda d: b"", "truncated: 0 bytes"),
    "short-header": (lambda d: d[:40], "truncated: 40 bytes"),
    "truncated-payload": (lambda d: d[:-1], "truncated"),
    "trailing-bytes": (lambda d: d + b"\0", "1 trailing bytes"),
    "magic": (lambda d: b"GGUF" + d[4:], "not a .ninfer file"),
    "version": (lambda d: _header_edit(d, 8, "<I", 2), "version 2 is not supported; this reader reads version 1"),
    "header-checksum": (lambda d: d[:20] + bytes([d[20] ^ 1]) + d[21:], "header checksum"),
    "flags": (lambda d: _header_edit(d, 12, "<I", 4), "flags 0x4"),
    "dir-too-large": (lambda d: _header_edit(d, 16, "<Q", MAX_DIRECTORY_BYTES + 1), "exceeds the limit"),
    "dir-huge-u64": (lambda d: _header_edit(d, 16, "<Q", 2**64 - 1), "exceeds the limit"),
    "payload-offset": (lambda d: _header_edit(d, 24, "<Q", 8192), "payload offset 8192"),
    "dir-checksum": (lambda d: d[:100] + bytes([d[100] ^ 4]) + d[101:], "directory checksum"),
    "padding": (lambda d: d[:4000] + b"x" + d[4001:], "non-zero bytes between"),
}


@pytest.mark.parametrize("case", list(FRAMING), ids=list(FRAMING))
def test_framing_errors(tmp_path, tp1, case):
    mutate, match = FRAMING[case]
    _expect(tmp_path, mutate(_read(tp1)), match)


def _set(path, value):
    def fn(d, payload):
        obj = d
        for k in path[:-1]:
            obj = obj[k]
        if value is _DEL:
            del obj[path[-1]]
        else:
            obj[path[-1]] = value(obj[path[-1]]) if callable(value) else value
    return fn


_DEL = object()
T0 = ("tensors", 0)
RAW_DIRECTORY = {
    "bad-json": (b'{"model": ', "invalid JSON"),
    "not-object": (b"[1, 2]", "not a JSON object"),
    "duplicate-key": (b'{"tp": 1, "tp": 2}', "duplicate member 'tp'"),
    "nan": (b'{"tp": NaN}', "NaN is not allowed"),
    "huge-float": (b'{"tp": 1e999}', "out of range"),
    "bom": ("\ufeff{}".encode(), "byte order mark"),
    "bad-utf8": (b'{"\xff": 1}', "invalid UTF-8"),
    "deep-nesting": (b"[" * 100000 + b"]" * 100000, "directory"),
}


@pytest.mark.parametrize("case", list(RAW_DIRECTORY), ids=list(RAW_DIRECTORY))
def test_malformed_directory_json(tmp_path, tp1, case):
    raw, match = RAW_DIRECTORY[case]
    _expect(tmp_path, build(raw, split(_read(tp1))[1]), match)


SCHEMA = {
    "unknown-member": (_set(("bogus",), 1), "bogus: unknown member"),
    "missing-member": (_set(("resources",), _DEL), "resources: missing member"),
    "missing-tensor-field": (_set(T0 + ("xxh3",), _DEL), r"tensors\[0\].xxh3: missing"),
    "misaligned": (_set(T0 + ("offset",), 8), "not a multiple of 256"),
    "overlap": (_set(("tensors", 1, "offset"), 0), "not sorted"),
    "overlap-resource": (_set(("resources", 0, "offset"), 256), "overlaps"),
    "out-of-bounds": (_set(("resources", 1, "offset"), 1 << 40), "outside the payload"),
    "length-mismatch": (_set(T0 + ("length",), lambda v: v + 2), "encodes to"),
    "shape-mismatch": (_set(T0 + ("shape",), [37, 25]), "encodes to"),
    "unknown-format": (_set(T0 + ("format",), "q4_k"), "unknown format 'q4_k'"),
    "bool-offset": (_set(T0 + ("offset",), True), "expected an integer, got bool"),
    "float-offset": (_set(T0 + ("offset",), 0.0), "expected an integer, got float"),
    "negative-offset": (_set(T0 + ("offset",), -256), "out of range"),
    "huge-offset": (_set(T0 + ("offset",), 1 << 60), "out of range"),
    "quantized-rank": (_set(("tensors", 3, "shape"), [5, 48, 1]), "needs rank 2"),
    "k-multiple": (_set(("tensors", 4, "shape"), [3, 500]), "multiple of 256"),
    "duplicate-name": (_set(("tensors", 1, "name"), "embed_tokens.weight"), "duplicate name"),
    "duplicate-resource": (_set(("resources", 1, "name"), "chat_template.jinja"), "duplicate name"),
    "bad-encoding": (_set(("resources", 1, "encoding"), "gzip"), "encoding"),
    "raw-length": (_set(("resources", 0, "raw_length"), 3), "raw_length"),
    "bad-hex": (_set(T0 + ("xxh3",), "ABC"), "lowercase hex"),
    "tp-rank": (_set(("tp", "rank"), 1), r"tp.rank: 1 is out of range \[0, 1\)"),
    "tp-file-name": (_set(("tp", "files", 0, "name"), "x.tp2-rank0.ninfer"), "is not '<stem>.tp1-rank0"),
    "model-field": (_set(("model", "rope_theta"), "big"), "model.rope_theta: expected a number"),
    "model-unknown": (_set(("model", "bogus"), 1), "model.bogus: unknown member"),
    "model-consistency": (_set(("model", "num_hidden_layers"), 3), "layer_types"),
    "recipe-type": (_set(("identity", "recipe"), []), "identity.recipe: expected an object"),
}


@pytest.mark.parametrize("case", list(SCHEMA), ids=list(SCHEMA))
def test_directory_schema_errors(tmp_path, tp1, case):
    mutate, match = SCHEMA[case]
    _expect(tmp_path, edited(_read(tp1), mutate), match)


def test_self_consistency_errors(tmp_path, tp1):
    data = _read(tp1)
    # tables altered but the recorded digest kept: the shard digest catches it
    _expect(tmp_path, edited(data, _set(T0 + ("xxh3",), "0" * 32), digests=False), "shard_digest")
    _expect(tmp_path, edited(data, _set(("identity", "artifact_id"), "1" * 32), digests=False), "artifact_id")
    d, payload = split(data)
    d["tp"]["files"][0]["payload_length"] = 5
    _expect(tmp_path, build(d, payload), r"payload_length: 5 != this file's payload length")
    d, payload = split(data)
    _expect(tmp_path, build(d, payload + bytes(256)), "last entry ends")


@pytest.mark.parametrize("target", list(MIXED) + list(RESOURCES))
def test_flipped_bit_is_named(tmp_path, tp1, target):
    data = bytearray(_read(tp1))
    with open_artifact(tp1) as a:
        e = a.tensors.get(target) or a.resources[target]
        pos = a.header.payload_offset + e.offset + e.length // 2
    data[pos] ^= 0x10
    msg = _expect(tmp_path, bytes(data), f"{target}: checksum mismatch", verify=True, exc=ChecksumError)
    assert target in msg
    open_artifact_ok = open_artifact(tmp_path / "bad.tp1-rank0.ninfer")      # structure is still fine
    if target in RESOURCES:
        with pytest.raises(ChecksumError):
            open_artifact_ok.resource(target)
    open_artifact_ok.close()


def test_nonzero_gap_caught_by_verify(tmp_path, tp1):
    data = bytearray(_read(tp1))
    with open_artifact(tp1) as a:
        e = a.tensors["layers.0.linear_attn.A_log"]              # 6 bytes, then a 250-byte gap
        pos = a.header.payload_offset + e.offset + e.length + 7
    data[pos] = 1
    _expect(tmp_path, bytes(data), "non-zero bytes in the gap", verify=True)


# ---- TP sets ---------------------------------------------------------------------------------
def test_mixed_and_incomplete_sets(tmp_path):
    rng = np.random.default_rng(11)
    a = write_artifact(tmp_path / "a", "m", tiny_config(), [random_tensors(rng), random_tensors(rng)], RESOURCES, META)
    b = write_artifact(tmp_path / "b", "m", tiny_config(), [random_tensors(rng), random_tensors(rng)], RESOURCES, META)
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    os.link(a[0], mixed / "m.tp2-rank0.ninfer")
    os.link(b[1], mixed / "m.tp2-rank1.ninfer")
    problems = verify_paths([mixed])
    assert problems and "mixed TP set" in problems[0]
    assert "mixed TP set" in verify_paths([mixed / "m.tp2-rank0.ninfer"])[0]
    os.unlink(mixed / "m.tp2-rank1.ninfer")
    assert "incomplete TP set: rank 1" in verify_paths([mixed])[0]
    with pytest.raises(FormatError, match="incomplete TP set"):
        verify_paths([mixed], raise_first=True)
    assert "no such file" in verify_paths([tmp_path / "nope.ninfer"])[0]
    assert all(isinstance(p, str) and "\n" not in p for p in verify_paths([mixed, tmp_path / "a"]))


def test_errors_are_ninfer_errors():
    assert issubclass(ChecksumError, FormatError) and issubclass(FormatError, NinferError)


@pytest.mark.parametrize("call", ["pwrite", "write"], ids=["tensor-pwrite", "journal-append"])
def test_disk_full_names_the_file(tmp_path, tensors, monkeypatch, call):
    """os.pwrite/os.write on an fd raise OSError without a file name; the CLI would print `error: : ...`."""
    import errno

    def full(*a):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(os, call, full)
    with pytest.raises(OSError) as e:
        write_artifact(tmp_path, "m", tiny_config(), [tensors], RESOURCES, META)
    assert e.value.errno == errno.ENOSPC
    assert e.value.filename.endswith("m.tp1-rank0.ninfer.partial" + ("" if call == "pwrite" else ".journal"))
