"""bench/allreduce.py's report logic on made-up timings (the measurement itself needs 2 GPUs)."""
from __future__ import annotations

import argparse
import os
import sys

import pytest

sys.path.append(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import allreduce as bench

SIZES = (2048, 10240, 65536, 262144, 1048576, 4194304)


def records(graph_us: dict) -> list[dict]:
    out = []
    for impl, per_size in graph_us.items():
        for n, us in zip(SIZES, per_size):
            for mode in bench.MODES:
                out.append({"impl": impl, "bytes": n, "mode": mode, "us": us * (3 if mode == "eager" else 1),
                            "gpu": "fake", "exact": None if impl == "floor" else True})
    return out


def test_parse_sizes():
    assert bench.parse_sizes("4K,2k,10K,1M,4096") == (2048, 4096, 10240, 1048576)
    for bad in ("3", "10X", "0", "-16", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="--sizes"):
            bench.parse_sizes(bad)


@pytest.mark.parametrize("one,two,want", [
    ((4, 4.5, 6, 9, 30, 100), (7, 7, 8, 10, 20, 80), [[262144, "one_shot"], [1048576, "two_shot"]]),
    ((4, 4.5, 6, 30, 90, 300), None, [[65536, "one_shot"]]),
    ((30, 30, 30, 40, 90, 300), None, []),
    ((4, 25, 6, 30, 90, 300), None, [[65536, "one_shot"]]),     # a lone NCCL win inside the one-shot range
], ids=["one_then_two_shot", "one_shot_only", "nccl_everywhere", "noisy_middle"])
def test_suggest_crossover(one, two, want):
    t = {"nccl": (22, 22, 24, 26, 35, 70), "one_shot": one, "floor": (2,) * 6}
    if two:
        t["two_shot"] = two
    assert bench.suggest_crossover(records(t), SIZES) == want


def test_summary_and_table():
    res = {"records": records({"nccl": (22,) * 6, "one_shot": (4, 5.5, 6, 9, 30, 100), "floor": (2,) * 6}),
           "bench_p2p": "peer memory on: one_shot", "runtime_p2p": "eager+graph"}
    s = bench.summarize(res, SIZES)
    assert s["one_shot_10KiB_graph_us"] == 5.5 and s["meets_goal"] and s["all_exact"]
    assert s["suggested_crossover"] == [[262144, "one_shot"]]
    lines = bench.table(s["records"], SIZES).splitlines()
    assert len(lines) == 1 + len(SIZES) and lines[2].split()[0] == "10240" and lines[2].split()[-1] == "4.00"
    res["records"][0]["exact"] = False
    assert not bench.summarize(res, SIZES)["all_exact"]
