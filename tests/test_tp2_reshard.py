"""bench/tp2_check.py's TP1 -> TP2 cut: every rank tensor decodes to its rows/columns of the TP1 tensor
(packer split table), and the cut set loads as a TP set."""
from __future__ import annotations

import dataclasses
import os
import sys

import numpy as np
import pytest

sys.path.append(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import synth_artifact as synth
import tp2_check
from ninfer_formats.codecs import decode
from ninfer_formats.container import open_artifact

from ninfer_pack.tp_split import plan_split
from ninfer_rt.loader import load


def expected_piece(full: np.ndarray, split, rank: int) -> np.ndarray:
    if split.replicated:
        return full
    take = [np.take(full, np.arange(a, b), axis=split.dim) for a, b in split.ranges[rank]]
    return np.concatenate(take, axis=split.dim)


@pytest.mark.parametrize("recipe", ["bf16", "nvfp4"])
def test_reshard_gives_each_rank_its_slices(tmp_path, recipe):
    paths, _ = synth.build(str(tmp_path / "tp1"), dataclasses.replace(synth.TINY, mtp=False), recipe, 1, workers=1)
    out = tp2_check.reshard(paths[0], str(tmp_path / "tp2"), 2)
    assert len(out) == 2 and tp2_check.reshard(paths[0], str(tmp_path / "tp2"), 2) == out    # reused
    with open_artifact(paths[0]) as src:
        ranks = [open_artifact(p) for p in out]
        try:
            multi = 0
            for name, e in src.tensors.items():
                split = plan_split(name, e.shape, src.config, 2, e.fmt)
                multi += not split.replicated and len(split.ranges[0]) > 1
                full = decode(e.fmt, src.raw(name), e.shape)
                for r, a in enumerate(ranks):
                    re = a.tensors[name]
                    assert tuple(re.shape) == tuple(split.rank_shape) and re.fmt == e.fmt, name
                    got = decode(re.fmt, a.raw(name), re.shape)
                    np.testing.assert_array_equal(got, expected_piece(full, split, r), err_msg=f"{name} rank {r}")
            assert multi > 0                      # the q|k|v style multi-run row cuts were exercised
        finally:
            for a in ranks:
                a.close()
    for r in range(2):
        assert load(str(tmp_path / "tp2"), rank=r, tp_size=2).config.hidden_size == synth.TINY.hidden
