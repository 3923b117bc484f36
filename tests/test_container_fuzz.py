"""Seeded fuzzing of headers and directories: a reader must answer every mutated file with a one-line
NinferError (or accept it, when the mutation happens to be valid), never any other exception or a hang."""
from __future__ import annotations

import copy
import json
import random
import struct

import numpy as np
import pytest

from container_util import META, RESOURCES, build, fix_digests, random_tensors, rehash_header, split, tiny_config
from ninfer_formats.container import open_artifact, write_artifact
from ninfer_formats.errors import NinferError

CASES = 2400
SEED = 20261129
VALUES = [0, 1, -1, 255, 256, 4096, 2**31, 2**53 - 1, 2**53, 2**63, 2**64, 10**400, 0.5, -0.0, 1e308, "",
          "x" * 300, "\x00", "é", "nvfp4", "q6_k", "0" * 32, None, True, False, [], [1], [2**31, 3], {}, {"a": 1}]


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, prefix + (i,))


def _mutate_json(d: dict, rng: random.Random) -> dict:
    d = copy.deepcopy(d)
    path = rng.choice(list(_paths(d))[1:])
    parent = d
    for k in path[:-1]:
        parent = parent[k]
    key, op = path[-1], rng.random()
    if op < 0.55:
        parent[key] = rng.choice(VALUES)
    elif op < 0.65:
        del parent[key]
    elif op < 0.75 and isinstance(parent, dict):
        parent[rng.choice(["bogus", "name", "offset", "xxh3"])] = rng.choice(VALUES)
    elif op < 0.85 and isinstance(parent[key], int) and not isinstance(parent[key], bool):
        parent[key] += rng.choice([-257, -256, -1, 1, 255, 256, 4096])
    elif isinstance(parent, list):
        parent.insert(rng.randrange(len(parent) + 1), copy.deepcopy(parent[key]))   # duplicate an entry
    else:
        parent[key] = copy.deepcopy(rng.choice(list(d.values())))
    return d


def _mutate(base: bytes, rng: random.Random) -> tuple[str, bytes, bool]:
    """(kind, mutated file, whether to verify checksums too)."""
    d, payload = split(base)
    raw_dir = json.dumps(d).encode()
    kind = rng.choice(["header_bits", "header_field", "dir_bits", "dir_splice", "json", "json", "json",
                       "payload_bits", "resize"])
    if kind == "header_bits":
        b = bytearray(base)
        for _ in range(rng.randint(1, 3)):
            b[rng.randrange(64)] ^= 1 << rng.randrange(8)
        return kind, bytes(rehash_header(b) if rng.random() < 0.7 else b), False
    if kind == "header_field":
        b = bytearray(base)
        off, fmt = rng.choice([(8, "<I"), (12, "<I"), (16, "<Q"), (24, "<Q"), (32, "<Q")])
        cur = struct.unpack_from(fmt, b, off)[0]
        top = 2 ** (8 * struct.calcsize(fmt))
        struct.pack_into(fmt, b, off, rng.choice([0, 1, 2, top - 1, cur + 1, cur - 1 if cur else 1,
                                                  cur + 4096, rng.randrange(top)]) % top)
        return kind, bytes(rehash_header(b)), False
    if kind == "dir_bits":
        b = bytearray(raw_dir)
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        return kind, build(bytes(b), payload), False
    if kind == "dir_splice":
        i, j = sorted(rng.randrange(len(raw_dir) + 1) for _ in range(2))
        k = rng.randrange(len(raw_dir) + 1)
        spliced = raw_dir[:k] + raw_dir[i:j] + raw_dir[k:] if rng.random() < 0.5 else raw_dir[:i] + raw_dir[j:]
        return kind, build(spliced, payload), False
    if kind == "json":
        m = _mutate_json(d, rng)
        if rng.random() < 0.7:
            fix_digests(m)                     # get past the digest check into geometry / verify
        try:
            return kind, build(m, payload), True
        except (ValueError, TypeError):        # the mutation is not even serialisable as JSON
            return kind, build(json.dumps(m, default=str).encode(), payload), True
    if kind == "payload_bits":
        b = bytearray(base)
        b[rng.randrange(len(base) - len(payload), len(base))] ^= 1 << rng.randrange(8)
        return kind, bytes(b), True
    n = rng.choice([0, 1, 63, 64, 65, 4095, 4096, len(base) - 1, len(base) + 1, rng.randrange(len(base))])
    return kind, (base + bytes(8))[:n], False


def _exercise(path, verify: bool) -> None:
    with open_artifact(path, verify=verify) as a:
        for name, e in a.tensors.items():
            a.raw(name)
            if e.fmt in ("f32", "f16", "bf16", "i32"):
                a.array(name)
        for name in a.resources:
            a.resource(name)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz")
    path = write_artifact(d, "f", tiny_config(), [random_tensors(np.random.default_rng(5))], RESOURCES, META)[0]
    with open(path, "rb") as f:
        return f.read()


def test_fuzz_headers_and_directories(tmp_path, base):
    rng = random.Random(SEED)
    path = tmp_path / "f.tp1-rank0.ninfer"
    outcomes: dict[str, int] = {}
    for case in range(CASES):
        kind, data, verify = _mutate(base, rng)
        path.write_bytes(data)
        try:
            _exercise(path, verify)
            outcome = "accepted"
        except NinferError as e:
            msg = str(e)
            assert msg and "\n" not in msg, f"case {case} ({kind}): multi-line error {msg!r}"
            outcome = "refused"
        except Exception as e:  # noqa: BLE001 - the point of the test
            pytest.fail(f"case {case} ({kind}, seed {SEED}): {type(e).__name__}: {e}")
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    # the fuzzer must mostly produce invalid files, yet reach deep enough that some survive
    assert outcomes.get("refused", 0) > CASES * 0.6, outcomes
    assert sum(outcomes.values()) == CASES
