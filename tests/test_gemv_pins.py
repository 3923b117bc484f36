"""GEMV config pins (kernels/gemv_pins.py): a shipped pin replaces the standalone tuner's pick when the table is
built, a runtime pin (NINFER_GEMV_PINS) outranks the user cache, the shipped table and re-timing, and a pin that
names nothing measured or cannot be read is a one-line error."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ninfer_kernels import gemv_launch as gl
from ninfer_kernels import gemv_pins
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
                                     "--out", str(out), *a], capture_output=True, text=True, timeout=120,
                                     check=False)
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


KEY = tc.TuneKey("NVIDIA H200", "9.0", "0.0-any", "nvfp4+xpre", 34816, 5120, 1, "torch.bfloat16", False)


@pytest.fixture
def pins_env(monkeypatch, tmp_path):
    """Write a runtime pins file, point NINFER_GEMV_PINS at it, start from nothing read; a user cache that
    remembers FAST for KEY."""
    monkeypatch.setenv("NINFER_CACHE_DIR", str(tmp_path))
    tc.reset()
    tc.record(KEY, tc.parse_config(FAST), 0.0329)

    def write(pins):
        path = tmp_path / "runtime_pins.json"
        path.write_text(json.dumps(pins))
        monkeypatch.setenv(gemv_pins.PINS_ENV, str(path))
        tc.reset()
        return path
    yield write
    tc.reset()


def test_runtime_pin_outranks_cache_table_and_retiming(pins_env, monkeypatch):
    assert tc.lookup(KEY, 16) == tc.parse_config(FAST)            # the user cache, no pin yet
    pins_env([_pin(us=40.0)])
    assert tc.lookup(KEY, 16) == tc.parse_config(SLOW)
    assert tc.remembered_ms(KEY) == pytest.approx(0.040)
    assert tc.lookup(tc.TuneKey(**{**vars(KEY), "t_bucket": 2}), 16) != tc.parse_config(SLOW)   # other keys: as before
    # NINFER_GEMV_TUNE=force re-times everything except a pinned key
    monkeypatch.setenv("NINFER_GEMV_TUNE", "force")
    monkeypatch.setattr(tc, "device_identity", lambda device: ("NVIDIA H200", "9.0"))
    monkeypatch.setattr(gl, "interpreting", lambda: False)
    monkeypatch.setattr(gl, "_TUNED", {})
    monkeypatch.setattr(gl, "pick_config", lambda *a: pytest.fail("a pinned key was re-timed"))
    cands = [tc.parse_config(FAST), tc.parse_config(SLOW)]
    key = gl.tune_key("nvfp4_gemv_kernel+xpre", 34816, 5120 // 16, 1, torch.bfloat16, False, "cuda:0")
    assert gl.choose_config(key, cands, None, torch.device("cuda", 0), 16) == (tc.parse_config(SLOW), True)


def test_runtime_pin_unusable_here_is_ignored(pins_env):
    mma_t1 = "GemvConfig(block_n=128, block_g=8, num_warps=4, num_stages=2, split=1, use_dot=False, t_tile=0, h2=False, mma=True)"
    pins_env([_pin(config=mma_t1)])
    assert tc.pinned(tc.TuneKey(**{**vars(KEY), "cc": "7.0"}), 16) is None     # no warp-MMA on sm_70
    assert tc.pinned(KEY, 16) == tc.parse_config(mma_t1)


@pytest.mark.parametrize("value, words", [
    ("", None), ("0", None),
    ("/no/such/pins.json", "unreadable ("),
    ("bad-pin", "pin 0 (nvfp4+xpre [34816, 5120] T=1): not a GemvConfig repr"),
    ("not-a-list", "expected a list of pins"),
], ids=["unset", "zero", "missing", "bad-pin", "not-a-list"])
def test_runtime_pins_env_error(value, words, monkeypatch, tmp_path):
    if value in ("bad-pin", "not-a-list"):
        path = tmp_path / f"{value}.json"
        path.write_text(json.dumps([_pin(config="split=1")] if value == "bad-pin" else {"pins": []}))
        value = str(path)
    monkeypatch.setenv(gemv_pins.PINS_ENV, value)
    gemv_pins.reset()
    err = gemv_pins.pins_env_error()
    if words is None:
        assert err is None and gemv_pins.runtime_pins() == {}
    else:
        assert err.startswith(f"NINFER_GEMV_PINS={value!r}: ") and words in err and "\n" not in err
    gemv_pins.reset()


def _near_ties():
    import importlib.util
    spec = importlib.util.spec_from_file_location("near_ties", Path(__file__).resolve().parents[1] / "bench" / "near_ties.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _runoff_rec(T, pick, runoff, fmt="nvfp4+xpre", shape=(34816, 5120)):
    cfg = lambda s: FAST.replace("split=3", f"split={s}")   # noqa: E731
    return {**_rec(cfg(pick), dict(runoff)[pick], T=T, shape=shape), "format": fmt,
            "runoff_us": [[cfg(s), us] for s, us in runoff]}


def test_near_ties_pin_the_fewest_splits_within_tol():
    nt = _near_ties()
    records = [_runoff_rec(1, 3, [(3, 32.9), (1, 33.2), (2, 34.0)]),      # split 1 within 1 %: pinned
               _runoff_rec(2, 7, [(7, 34.0), (4, 35.0)]),                  # 2.9 % behind: not at 1 %
               _runoff_rec(4, 2, [(2, 30.0), (5, 30.1)]),                  # more splits: never
               _runoff_rec(1, 3, [(3, 32.9), (1, 33.2)], fmt="q6_k"),      # format not asked for
               _runoff_rec(1, 5, [(5, 10.0), (4, 10.05)], shape=(5120, 6144)),
               _runoff_rec(1, 5, [(5, 10.0), (4, 10.05)], shape=(5120, 6144))]   # a second record of one key
    pins = nt.near_ties(records, 0.01, "NVIDIA H200", {"nvfp4+xpre"}, {1, 2, 4})
    assert [(p["T"], p["shape"][0], tc.parse_config(p["config"]).split, p["us"]) for p in pins] == \
        [(1, 34816, 1, 33.2), (1, 5120, 4, 10.05)]
    assert [p["T"] for p in nt.near_ties(records, 0.03, "NVIDIA H200", {"nvfp4+xpre"}, {1, 2, 4})] == [1, 2, 1]
    skip = {gemv_pins.record_key(records[0])}
    assert len(nt.near_ties(records, 0.01, "NVIDIA H200", {"nvfp4+xpre"}, {1}, skip)) == 1
    for p in pins:                                  # what the sweep loads through NINFER_GEMV_PINS
        gemv_pins.check_pin(0, p)


def test_near_ties_cli(tmp_path):
    results = tmp_path / "kernels.json"
    results.write_text(json.dumps([_runoff_rec(1, 3, [(3, 32.9), (1, 33.2)])]))
    script = Path(__file__).resolve().parents[1] / "bench" / "near_ties.py"
    run = lambda *a: subprocess.run([sys.executable, str(script), str(results), *a], capture_output=True,  # noqa: E731
                                    text=True, timeout=120, check=False)
    p = run("--out", str(tmp_path / "near.json"))
    assert p.returncode == 0 and json.loads(p.stdout) == {"out": str(tmp_path / "near.json"), "pins": 1}
    assert len(gemv_pins.load_pins(tmp_path / "near.json")) == 1
    (tmp_path / tc.PINS_NAME).write_text(json.dumps([_pin(us=33.2)]))     # the shipped pins settle that key
    p = run("--out", str(tmp_path / "near.json"))
    assert p.returncode == 0 and json.loads(p.stdout)["pins"] == 0
    for args, words in ((["--tol", "1.5"], "--tol 1.5"), ([], f"{results}: expected a list")):
        if not args:
            results.write_text("{}")
        p = run("--out", str(tmp_path / "x.json"), *args)
        assert p.returncode == 2 and words in p.stderr and len(p.stderr.strip().splitlines()) == 1
        assert not (tmp_path / "x.json").exists()
