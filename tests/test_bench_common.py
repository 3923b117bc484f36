"""What the benchmark scripts share (bench/bench_cli.py, bench/bench_device.py): the scratch-folder choice and
its one-line error, the argument types, and the walk over a model's weights that bytes per step, parameter
counts and the precompile's shape list are built on (stand-in objects with a cycle, a tensor held twice, a
float in a QWeight and an attribute the walk must not enter)."""
from __future__ import annotations

import argparse
import os
import sys

import pytest
import torch

sys.path.append(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import bench_cli
import bench_device as D

from ninfer_formats.errors import NinferError
from ninfer_rt.weights import QWeight


def test_pick_dir(tmp_path):
    assert bench_cli.pick_dir(str(tmp_path), 1 << 60) == str(tmp_path)          # given: taken as is
    assert os.path.basename(bench_cli.pick_dir(None, 1)) == "ninfer-bench"
    with pytest.raises(NinferError, match=r"no folder with .* GB free .*pass --dir"):
        bench_cli.pick_dir(None, 1 << 60)


@pytest.mark.parametrize("fn,text,want", [
    (bench_cli.positive_int, "7", 7), (bench_cli.positive_int, "0", None), (bench_cli.positive_int, "x", None),
    (bench_cli.nonneg_int, "0", 0), (bench_cli.nonneg_int, "-1", None),
    (bench_cli.int_list, "4,1,4", (4, 1, 4)), (bench_cli.int_list, "1,,2", (1, 2)), (bench_cli.int_list, ",", None),
    (bench_cli.int_list, "1,-2", None), (bench_cli.name_list(("a", "b")), "b, a", ("b", "a")),
    (bench_cli.name_list(("a", "b")), "a,c", None),
], ids=lambda v: getattr(v, "__name__", repr(v)))
def test_argument_types(fn, text, want):
    if want is None:
        with pytest.raises(argparse.ArgumentTypeError, match=repr(text)):
            fn(text)
    else:
        assert fn(text) == want


class _Part:
    __module__ = "ninfer_rt.stand_in"        # the walk enters ninfer_rt objects only

    def __init__(self, **kw):
        vars(self).update(kw)


def _model():
    shared = torch.zeros(3, 5)
    w = QWeight("bf16", (3, 5), {"w": shared})
    q = QWeight("nvfp4", (4, 32), {"codes": torch.zeros(4, 16, dtype=torch.uint8),
                                   "scales": torch.zeros(4, 2, dtype=torch.uint8), "gscale": 0.5})
    mixer = _Part(w=w, norm=torch.ones(7), ops=_Part(table=torch.ones(1000)))     # ops: not the model's
    mlp = _Part(ws=[q, w, q], alias=shared)
    root = _Part(blocks=[_Part(mixer=mixer, mlp=mlp)], cfg=torch.ones(1000))
    mlp.block = root.blocks[0]                                                    # a cycle
    return root, w, q


def test_walk_counts_each_weight_once():
    root, w, q = _model()
    assert {id(x) for x in D.qweights(root)} == {id(w), id(q)} and len(D.qweights(root)) == 2
    got = D.tensors(root)
    assert sum(t.nbytes for t in got) == 3 * 5 * 4 + 7 * 4 + 4 * 16 + 4 * 2      # shared tensor once, no gscale
    seen = set()
    D.tensors(root.blocks[0].mixer, seen)
    rest = D.tensors(root, seen)                                                  # what the mixer did not hold
    assert sum(t.nbytes for t in rest) == 4 * 16 + 4 * 2


def test_ceilings_on_cpu():
    assert D.copy_tbps("cpu", 1, reps=2) > 0 and D.matmul_tflops("cpu", 16, torch.float32, reps=2) > 0
    assert D.device_name("cpu").startswith("cpu (")


def test_ab_tree_exports_a_commits_packages(tmp_path):
    """bench/ab_tree.sh: an earlier commit's runtime packages under .ab/NAME with the import names the device's
    PYTHONPATH needs (kernels -> ninfer_kernels), byte for byte, not the working tree's; a bad commit or name is
    a one-line error. Runs in a scratch repository holding a copy of the script."""
    import shutil
    import subprocess
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    repo = tmp_path / "repo"
    for d in ("bench", "kernels", "formats"):
        (repo / d).mkdir(parents=True)
    shutil.copy(os.path.join(root, "bench", "ab_tree.sh"), repo / "bench" / "ab_tree.sh")
    (repo / "kernels" / "k.py").write_text("old = 1\n")
    (repo / "formats" / "f.py").write_text("fmt = 1\n")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    for cmd in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "old"]):
        subprocess.run(git + cmd, check=True, capture_output=True)
    (repo / "kernels" / "k.py").write_text("new = 2\n")          # the working tree moved on; the export must not
    script = ["bash", str(repo / "bench" / "ab_tree.sh")]
    p = subprocess.run(script + ["HEAD", "pre", "kernels", "formats"], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    out = repo / ".ab" / "pre"
    assert sorted(os.listdir(out)) == ["ninfer_formats", "ninfer_kernels"]
    assert (out / "ninfer_kernels" / "k.py").read_text() == "old = 1\n"
    assert "/.ab/" in (repo / ".git" / "info" / "exclude").read_text().split()
    for args, msg in ((["no-such-rev", "x"], "no commit no-such-rev"), (["HEAD", "head"], "NAME must be")):
        p = subprocess.run(script + args, capture_output=True, text=True)
        assert p.returncode == 2 and msg in p.stderr and len(p.stderr.strip().splitlines()) == 1
