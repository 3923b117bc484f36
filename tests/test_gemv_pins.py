"""Pins of the shipped GEMV table (kernels/gemv_tune_cache.apply_pins): an in-step A/B winner replaces the
standalone tuner's pick for its key, and a pin that names nothing measured is a one-line error."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from ninfer_kernels import gemv_tune_cache as tc

FAST = "GemvConfig(block_n=128, block_g=16, num_warps=4, num_stages=1, split=3, use_dot=False, t_tile=0, h2=True, mma=False)"
SLOW = "GemvConfig(block_n=64, block_g=16, num_warps=4, num_stages=1, split=1, use_dot=False, t_tile=0, h2=True, mma=False)"


def _rec(config, us, T=1, shape=(34816, 5120)):
    return {"gpu": "NVIDIA H200", "format": "nvfp4+xpre", "name": "mlp_gate_up", "tp": 1, "shape": list(shape),
            "T": T, "config": config, "us": us}


def _pin(**kw):
    return {**_rec(SLOW, 33.18), "why": "won in the step", **kw}


def _entry(doc, T=1):
    return next(e for e in doc["gpus"]["NVIDIA H200"] if e["t_bucket"] == T)


def test_pin_replaces_the_tuner_pick():
    records = [_rec(FAST, 32.9), _rec(SLOW, 33.18), _rec(FAST, 40.0, T=2)]
    plain = tc.build_shipped(records, "kernels.json")
    assert _entry(plain)["config"]["split"] == 3 and "pin" not in _entry(plain)
    doc = tc.build_shipped(records, "kernels.json", pins=[_pin()])
    e = _entry(doc)
    assert (e["config"]["split"], e["config"]["block_n"], e["us"], e["pin"]) == (1, 64, 33.18, "won in the step")
    assert _entry(doc, T=2) == _entry(plain, T=2)          # other keys keep the fastest record
    assert doc["heuristic"]["nvfp4+xpre"]["1"][0]["block_n"] == 64    # the shipped tile is the one ranked


@pytest.mark.parametrize("pin, words", [
    (_pin(T=4), "no kernels.json record"),
    (_pin(shape=[5120, 5120]), "no kernels.json record"),
    ({k: v for k, v in _pin().items() if k != "why"}, "needs gpu, format, shape, T, config, us and why"),
    (_pin(config="split=1"), "not a GemvConfig repr"),
    ("nvfp4", "needs gpu"),
], ids=["other-T", "other-shape", "no-why", "bad-config", "not-a-dict"])
def test_bad_pin_is_named(pin, words):
    with pytest.raises(tc.PinError, match="pin 0") as e:
        tc.build_shipped([_rec(FAST, 32.9)], "kernels.json", pins=[pin])
    assert words in str(e.value)


def test_cli_reads_pins_beside_the_results_and_names_a_bad_file(tmp_path):
    results = tmp_path / "kernels.json"
    results.write_text(json.dumps([_rec(FAST, 32.9), _rec(SLOW, 33.18)]))
    out = tmp_path / "tuned.json"
    run = lambda *a: subprocess.run([sys.executable, "-m", "ninfer_kernels.gemv_tune_cache", str(results),
                                     "--out", str(out), *a], capture_output=True, text=True, timeout=120)
    p = run()
    assert p.returncode == 0 and json.loads(p.stdout)["pins"] == 0
    assert _entry(json.loads(out.read_text()))["config"]["split"] == 3
    (tmp_path / tc.PINS_NAME).write_text(json.dumps([_pin()]))
    p = run()
    assert p.returncode == 0 and json.loads(p.stdout)["pins"] == 1
    assert _entry(json.loads(out.read_text()))["config"]["split"] == 1
    out.unlink()
    for bad in ("{not json", json.dumps({"pin": 1}), json.dumps([_pin(T=8)])):
        (tmp_path / tc.PINS_NAME).write_text(bad)
        p = run()
        assert p.returncode == 2 and not out.exists()
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: {tmp_path / tc.PINS_NAME}: "), p.stderr
    p = run("--pins", str(tmp_path / "missing.json"))
    assert p.returncode == 2 and "missing.json" in p.stderr and "Traceback" not in p.stderr


def test_repo_pins_name_measured_keys():
    """bench/results/gemv_pins.json applies to bench/results/kernels.json (the shipped table is built from both)."""
    results = Path(__file__).resolve().parents[1] / "bench" / "results"
    pins = tc.load_pins(results / tc.PINS_NAME)
    doc = tc.build_shipped(json.loads((results / "kernels.json").read_text()), "kernels.json", pins=pins)
    pinned = [e for e in doc["gpus"]["NVIDIA H200"] if "pin" in e]
    assert len(pinned) == len(pins) >= 1
