"""The GEMV tuner's persistent choices (kernels/gemv_tune_cache.py), on CPU: the GPU identity, the
capture check and the timer are replaced, so what is tested is which config is chosen and what is timed."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from ninfer_kernels import gemv_launch as gl
from ninfer_kernels import gemv_tiles as gt
from ninfer_kernels import gemv_tune_cache as tc
from ninfer_kernels.gemv_launch import GemvConfig
from gemv_inputs import as_h200, fake_cuda

CUDA = torch.device("cuda", 0)   # only an object: nothing here touches a GPU
CANDS = [GemvConfig(128, 16, 8, 2, split=5), GemvConfig(64, 16, 4, 1, split=3), GemvConfig(64, 16, 2, 1, split=3)]


@pytest.fixture
def gpu(monkeypatch, tmp_path):
    """A pretend CUDA device named by `gpu.name`, a fresh cache folder and a timer that counts its calls."""
    class State:
        name, calls, times = "NVIDIA H200", [], {}
    st = State()
    monkeypatch.setenv("NINFER_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("NINFER_GEMV_TUNE", raising=False)
    for mod in (gl, gt):
        monkeypatch.setattr(mod, "interpreting", lambda: False)
    monkeypatch.setattr(gl, "_capturing", lambda: False)
    monkeypatch.setattr(tc, "device_identity", lambda device: (st.name, "9.0"))

    def fake_time(fn, reps=12):
        return fn()
    monkeypatch.setattr(gl, "time_ms", fake_time)
    monkeypatch.setattr(gl, "_TUNED", {})
    monkeypatch.setattr(gl, "_TUNE_LOG", {})
    monkeypatch.setattr(gl, "RUNOFF_ROUNDS", 0)    # one timing per candidate unless a test asks for the runoff
    tc.reset()
    yield st
    tc.reset()


def _run(st):
    def run(c):
        st.calls.append(c)
        return st.times.get(c, 1.0)
    return run


def _key(N=4096, G=320, T=1, res=False, kernel="nvfp4_gemv_kernel"):
    return gl.tune_key(kernel, N, G, T, torch.bfloat16, res, CUDA)


def test_tuned_choice_round_trips_through_the_cache_file(gpu, tmp_path):
    gpu.times = {CANDS[0]: 3.0, CANDS[1]: 1.5, CANDS[2]: 2.0}
    cfg, final = gl.choose_config(_key(), CANDS, _run(gpu), CUDA, 16)
    assert (cfg, final) == (CANDS[1], True) and gpu.calls == CANDS
    doc = json.loads((tmp_path / "gemv_tune.json").read_text())
    assert doc["entries"] == [{"key": {"gpu": "NVIDIA H200", "cc": "9.0", "triton": tc.triton.__version__,
                                       "fmt": "nvfp4", "N": 4096, "K": 320 * 16, "t_bucket": 1,
                                       "dtype": "torch.bfloat16", "residual": False},
                               "config": vars(CANDS[1]) | {}, "ms": 1.5}]
    # a new process: nothing in memory, the file answers and nothing is timed
    gl._TUNED.clear()
    tc.reset()
    gpu.calls.clear()
    assert gl.choose_config(_key(), CANDS, _run(gpu), CUDA, 16) == (CANDS[1], True)
    assert gpu.calls == []


@pytest.mark.parametrize("field,value", [("gpu", "NVIDIA A100-SXM4-80GB"), ("T", 2), ("res", True),
                                         ("kernel", "q6_k_gemv_kernel"), ("N", 4095)],
                         ids=["other-gpu", "other-T-bucket", "residual", "other-format", "other-N"])
def test_key_contents_separate_entries(gpu, field, value):
    gpu.name = "Made-up GPU"   # no shipped defaults
    gl.choose_config(_key(), CANDS, _run(gpu), CUDA, 16)
    gl._TUNED.clear()
    tc.reset()
    gpu.calls.clear()
    if field == "gpu":
        gpu.name, kw = value, {}
    else:
        kw = {field: value}
    gl.choose_config(_key(**kw), CANDS, _run(gpu), CUDA, 16)
    assert gpu.calls == CANDS, "a different key must be tuned, not served from another key's entry"
    assert len(tc._user()) == 2


def test_key_rejects_wrong_types():
    with pytest.raises(TypeError, match="TuneKey.N"):
        tc.TuneKey("g", "9.0", "3.9.0", "nvfp4", 0, 16, 1, "torch.bfloat16", False)
    with pytest.raises(TypeError, match="TuneKey.residual"):
        tc.TuneKey("g", "9.0", "3.9.0", "nvfp4", 16, 16, 1, "torch.bfloat16", 1)


@pytest.mark.parametrize("content", ["{not json", '{"entries": 3}', "\xff\xfe"], ids=["bad-json", "no-list", "binary"])
def test_corrupt_file_is_ignored_with_one_line(gpu, tmp_path, capsys, content):
    gpu.name = "Made-up GPU"
    (tmp_path / "gemv_tune.json").write_text(content, encoding="latin-1")
    cfg, _ = gl.choose_config(_key(), CANDS, _run(gpu), CUDA, 16)
    assert cfg == CANDS[0] and gpu.calls == CANDS
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "gemv_tune.json" in err[0] and "ignored" in err[0]
    assert len(json.loads((tmp_path / "gemv_tune.json").read_text())["entries"]) == 1   # rewritten whole


def test_bad_entries_are_skipped_good_ones_used(gpu, tmp_path, capsys):
    gpu.name = "Made-up GPU"
    key = tc.make_key(_key(), 16, CUDA)
    good = {"key": vars(key), "config": vars(CANDS[2]), "ms": 1.0}
    bad_cfg = {"key": vars(key) | {"N": 7}, "config": {"block_n": 3, "block_g": 16}}
    unknown = {"key": vars(key) | {"colour": "red"}, "config": vars(CANDS[0])}
    (tmp_path / "gemv_tune.json").write_text(json.dumps({"entries": [bad_cfg, unknown, good, 5]}))
    assert gl.choose_config(_key(), CANDS, _run(gpu), CUDA, 16) == (CANDS[2], True)
    assert gpu.calls == []
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "3 unreadable entries" in err[0]


def test_shipped_defaults_answer_for_an_h200():
    tc.reset()
    ship = json.loads(tc.SHIPPED_PATH.read_text())
    e = next(e for e in ship["gpus"]["NVIDIA H200"] if e["fmt"] == "nvfp4" and e["t_bucket"] == 4)
    key = tc.TuneKey("NVIDIA H200", "9.0", "0.0-any", "nvfp4", e["N"], e["K"], 4, "torch.bfloat16", True)
    tc._USER = {}
    assert tc.lookup(key, 16) == GemvConfig(**e["config"])
    assert tc.lookup(tc.TuneKey(**{**vars(key), "gpu": "NVIDIA B200"}), 16) is None
    assert tc.lookup(tc.TuneKey(**{**vars(key), "dtype": "torch.float32"}), 16) is None
    tc.reset()


def test_shipped_file_matches_the_bench_results():
    """gemv_tuned.json is build_shipped(bench/results/kernels.json, its pins): regenerate it when either changes."""
    results = Path(__file__).resolve().parents[1] / "bench" / "results" / "kernels.json"   # the repo's, also
    # where ninfer_kernels is imported through a link (the device machine's PYTHONPATH)
    assert results.exists(), "bench/results/kernels.json is part of the repository"
    pins = tc.load_pins(results.with_name(tc.PINS_NAME))   # in-step A/B winners (tests/test_gemv_pins.py)
    built = tc.build_shipped(json.loads(results.read_text()), "kernels.json", pins=pins)
    assert built == json.loads(tc.SHIPPED_PATH.read_text())
    assert all(e["config"]["split"] >= 1 for e in built["gpus"]["NVIDIA H200"])


def test_shipped_h200_entry_skips_tuning(gpu):
    ship = json.loads(tc.SHIPPED_PATH.read_text())
    e = next(e for e in ship["gpus"]["NVIDIA H200"] if e["fmt"] == "iq3_s" and e["t_bucket"] == 2)
    key = gl.tune_key("iq3_s_gemv_kernel", e["N"], e["K"] // 256, 2, torch.bfloat16, False, CUDA)
    assert gl.choose_config(key, CANDS, _run(gpu), CUDA, 256) == (GemvConfig(**e["config"]), True)
    assert gpu.calls == []


def test_tune_off_picks_the_heuristic_without_timing(gpu, monkeypatch, tmp_path):
    monkeypatch.setenv("NINFER_GEMV_TUNE", "0")
    gpu.name = "Made-up GPU"
    # the H200's most frequent nvfp4 T=1 winner, placed behind a default that is not it
    top = json.loads(tc.SHIPPED_PATH.read_text())["heuristic"]["nvfp4"]["1"][0]
    want = GemvConfig(**top, split=3)
    assert want != CANDS[0]
    assert gl.choose_config(_key(), [CANDS[0], want, CANDS[2]], _run(gpu), CUDA, 16) == (want, True)
    assert gpu.calls == [] and not (tmp_path / "gemv_tune.json").exists()
    # no known tile among the candidates (or an unknown format): the default candidate
    odd = [GemvConfig(32, 8, 4, 1)]
    assert tc.heuristic("nvfp4", 1, odd + CANDS[:1]) == odd[0]
    assert tc.heuristic("no_such_fmt", 1, CANDS) == CANDS[0]


def test_cache_hit_never_calls_the_timer(gpu, monkeypatch):
    gpu.name = "Made-up GPU"
    tc.record(tc.make_key(_key(T=8, res=True), 16, CUDA), CANDS[2], 0.5)
    tc.reset()

    def no_timing(*a, **k):
        raise AssertionError("timed despite a cache hit")
    monkeypatch.setattr(gl, "time_ms", no_timing)
    monkeypatch.setenv("NINFER_GEMV_TUNE", "1")
    assert gl.choose_config(_key(T=7, res=True), CANDS, no_timing, CUDA, 16) == (CANDS[2], True)


def test_force_retunes_despite_a_cache_hit(gpu, monkeypatch):
    monkeypatch.setenv("NINFER_GEMV_TUNE", "force")
    tc.record(tc.make_key(_key(), 16, CUDA), CANDS[2], 0.5)
    gpu.times = {CANDS[0]: 0.1}
    assert gl.choose_config(_key(), CANDS, _run(gpu), CUDA, 16) == (CANDS[0], True)
    assert gpu.calls == CANDS


def test_unwritable_cache_warns_once_and_keeps_the_choice(gpu, monkeypatch, tmp_path, capsys):
    gpu.name = "Made-up GPU"
    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setenv("NINFER_CACHE_DIR", str(blocker / "sub"))   # a folder under a file: cannot be made
    tc.reset()
    gl.choose_config(_key(T=1), CANDS, _run(gpu), CUDA, 16)
    gl.choose_config(_key(T=2), CANDS, _run(gpu), CUDA, 16)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot write" in err[0]
    assert len(tc._user()) == 2


def test_parse_config_round_trips_repr():
    for c in CANDS + [GemvConfig(128, 4, 8, 3, 1, True, 64)]:
        assert tc.parse_config(repr(c)) == c
    with pytest.raises(ValueError):
        tc.parse_config("default")


@pytest.mark.parametrize("value", ["yes", "2", "FORCE", ""])
def test_bad_tune_mode_is_a_one_line_error(monkeypatch, value):
    monkeypatch.setenv("NINFER_GEMV_TUNE", value)
    with pytest.raises(gl.KernelInputError, match="NINFER_GEMV_TUNE=.*expected one of 0, 1, force"):
        gl.tune_mode()


@pytest.mark.parametrize("value", ["0", "1", "force"])
def test_good_tune_modes(monkeypatch, value):
    monkeypatch.setenv("NINFER_GEMV_TUNE", value)
    assert gl.tune_mode() == value


def test_h2_choice_is_checked_against_the_fp32_kernel(monkeypatch, capsys):
    """A packed-half2 config that wins the timing but disagrees with the fp32 kernel is replaced by the
    fastest fp32 config, and h2 stays off for the process (one stderr line)."""
    monkeypatch.setitem(gl.H2_STATE, "off", False)
    fp32_a, fp32_b, h2 = GemvConfig(64, 16, 4, 1), GemvConfig(128, 16, 4, 1), GemvConfig(128, 16, 4, 1, h2=True)
    want = torch.arange(1.0, 9.0)
    outs = {fp32_a: want, fp32_b: want, h2: want * (1 + 1e-3)}
    log = [(fp32_a, 0.30), (fp32_b, 0.20), (h2, 0.10)]
    assert gl.checked_h2(h2, [fp32_a, fp32_b, h2], log, lambda c: outs[c]) == h2     # within f16 rounding
    assert not gl.H2_STATE["off"] and capsys.readouterr().err == ""
    outs[h2] = want.flip(0)                                                             # a wrong decode
    assert gl.checked_h2(h2, [fp32_a, fp32_b, h2], log, lambda c: outs[c]) == fp32_b
    assert gl.H2_STATE["off"] and "disagrees" in capsys.readouterr().err
    outs[h2] = torch.full((8,), float("nan"))                                          # NaN never passes
    assert gl.checked_h2(h2, [fp32_a, h2], [(fp32_a, 0.3), (h2, 0.1)], lambda c: outs[c]) == fp32_a


def test_h2_candidates_follow_the_switch(monkeypatch):
    """candidates() for a CUDA device (its properties faked): h2 tiles only for kernels that have a variant,
    only for T <= 8, and none once a check has turned h2 off."""
    cuda = as_h200(monkeypatch)
    monkeypatch.setitem(gl.H2_STATE, "off", False)
    assert any(c.h2 for c in gl.candidates(1, 5120, 320, 16, torch.bfloat16, cuda, h2=True))
    assert not any(c.h2 for c in gl.candidates(1, 5120, 320, 16, torch.bfloat16, cuda, h2=False))
    assert not any(c.h2 for c in gl.candidates(16, 5120, 320, 16, torch.bfloat16, cuda, h2=True))
    monkeypatch.setitem(gl.H2_STATE, "off", True)
    assert not any(c.h2 for c in gl.candidates(1, 5120, 320, 16, torch.bfloat16, cuda, h2=True))


def test_h2_candidates_reach_several_waves(monkeypatch):
    """T <= 2: the first two h2 tiles also get the split that gives ~16 CTAs per SM, which for the 34816-row gate/up
    at 128 rows (272 row blocks, 4 CTAs of that tile fit an SM) is 8 (bench/NOTES.md §32: 7-8 won, 1-4 were tried)."""
    cuda = as_h200(monkeypatch)
    monkeypatch.setitem(gl.H2_STATE, "off", False)
    splits = {c.split for c in gl.candidates(1, 34816, 320, 16, torch.bfloat16, cuda, h2=True)
              if c.h2 and c.block_n == 128 and c.num_stages == 1 and c.num_warps == 4}
    assert {1, 2, 3, 4, 8} <= splits
    t4 = {c.split for c in gl.candidates(4, 34816, 320, 16, torch.bfloat16, cuda, h2=True) if c.h2}
    assert 8 not in t4                                             # verify-size tiles keep their one split


@pytest.mark.skipif(not torch.cuda.is_available(), reason="times a real launch: needs CUDA")
def test_time_ms_graph_and_eager_agree_on_order():
    """The graph timer (flush graph subtracted) ranks a 4x larger copy as slower, like the eager timer, and
    capture works on this device (no fallback)."""
    from ninfer_kernels import gemv_timing
    small = torch.empty(8 << 20, dtype=torch.uint8, device="cuda")
    big = torch.empty(32 << 20, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(big)
    t = {n: gemv_timing.time_ms(lambda s=s: dst[: s.numel()].copy_(s))
         for n, s in (("small", small), ("big", big))}
    e = {n: gemv_timing.time_ms(lambda s=s: dst[: s.numel()].copy_(s), graph=False)
         for n, s in (("small", small), ("big", big))}
    assert torch.cuda.current_device() not in gemv_timing._GRAPH_FAILED
    assert 0 < t["small"] < t["big"] and 0 < e["small"] < e["big"]
    assert t["big"] < 2 * e["big"]   # the subtraction leaves the copy, not the flush


@pytest.mark.parametrize("fmt_gs", [16, 8, 4, 2], ids=["gs16-nvfp4-q6k-iq3s", "gs8-f8", "gs4-plain16", "gs2-plain32"])
def test_candidates_sm70_dot_tiles_step_32_weights(monkeypatch, fmt_gs):
    """On a V100 (sm_70, 80 SMs) tl.dot is an FMA loop that holds a whole K step per thread: every dot tile,
    decode (T >= 4 only) and prefill, steps FMA_DOT_K weights at T tiles <= 32 (the tiles compile_check finds
    spill-free); an sm_90 device keeps its wider tensor-core steps."""
    dev = fake_cuda(monkeypatch, (7, 0), 80)
    for T in (1, 2, 4, 8, 16, 17, 300):
        dots = [c for c in gl.candidates(T, 5120, 5120 // fmt_gs, fmt_gs, torch.float16, dev) if c.use_dot]
        assert bool(dots) == (T >= 4), T
        assert all(c.block_g * fmt_gs == gl.FMA_DOT_K and c.num_stages == 1 and c.t_tile <= 32 for c in dots), dots
    as_h200(monkeypatch)
    dots = [c for c in gl.candidates(8, 5120, 5120 // fmt_gs, fmt_gs, torch.bfloat16, dev) if c.use_dot]
    assert dots and all(c.block_g * fmt_gs > gl.FMA_DOT_K for c in dots)


def test_candidates_few_rows_get_a_wide_split(monkeypatch):
    """The GDN b/a projections (96 rows of bf16): a handful of row blocks may split K up to 64 ways; wide shapes
    keep the cap of 16."""
    dev = as_h200(monkeypatch)
    assert max(c.split for c in gl.candidates(1, 96, 1280, 4, torch.bfloat16, dev)) == 64
    assert max(c.split for c in gl.candidates(1, 96, 40, 4, torch.bfloat16, dev)) == 3   # only 3 K tiles
    assert max(c.split for c in gl.candidates(1, 5120, 1280, 4, torch.bfloat16, dev)) <= 16


def test_candidates_h2_include_one_wave_splits(monkeypatch):
    """T <= 2: the first h2 tiles also get the largest splits whose CTAs all fit one wave at 4 or 8 per SM
    (attn_qkv: 112 row blocks of 128 rows -> 4 and 9 splits, besides auto_split's 5, 3, 10 and, for ~16 CTAs per
    SM, its cap of 16)."""
    dev = as_h200(monkeypatch)
    n128 = {c.split for c in gl.candidates(1, 14336, 320, 16, torch.bfloat16, dev, h2=True)
            if c.h2 and c.block_n == 128 and c.num_stages == 1}
    assert n128 == {3, 4, 5, 9, 10, 16}
    assert gl.fill_splits(112, 320, 132) == {4, 9} and gl.fill_splits(2000, 320, 132) == {1}
    t4 = [c for c in gl.candidates(4, 14336, 320, 16, torch.bfloat16, dev, h2=True) if c.h2]
    assert t4 and all(c.split == gl.auto_split(-(-14336 // c.block_n), 320 // c.block_g, 132) for c in t4)


def test_candidates_h2_stage_modes(monkeypatch):
    """The h2 candidates load then decode (1) or cp.async-pipeline 3 deep; the L2-prefetch mode that num_stages 2
    meant in session 7 is gone, and no candidate asks for 2."""
    dev = as_h200(monkeypatch)
    at = {T: {c.num_stages for c in gl.candidates(T, 14336, 320, 16, torch.bfloat16, dev, h2=True) if c.h2}
          for T in (1, 2, 4)}
    assert at[1] == {1, 3} and 2 not in at[2] | at[4]


def test_variant_format_lists_match_the_registered_kernels():
    """The cache's H2_FORMATS / MMA_FORMATS decide which remembered configs are usable: they must name exactly the
    formats with that variant (a format missing from MMA_FORMATS silently re-tunes in every process)."""
    import importlib
    for fmt in ("nvfp4", "q6_k", "iq3_s", "iq3_s4"):
        kernel = getattr(importlib.import_module(f"ninfer_kernels.gemv_{fmt}"), f"{fmt}_gemv_kernel")
        assert gl.has_variant(kernel, "h2") == (fmt in tc.H2_FORMATS), fmt
        assert gl.has_variant(kernel, "mma") == (fmt in tc.MMA_FORMATS), fmt
    ship = json.loads(tc.SHIPPED_PATH.read_text())
    e = next(e for e in ship["gpus"]["NVIDIA H200"] if e["fmt"] == "q6_k" and e["config"].get("mma"))
    key = tc.TuneKey("NVIDIA H200", "9.0", "any", "q6_k", e["N"], e["K"], e["t_bucket"], "torch.bfloat16", False)
    tc.reset()
    tc._USER = {}
    assert tc.lookup(key, 16) == GemvConfig(**e["config"])     # Q6_K GEMVs run on 16-weight groups
    tc.reset()


def test_prepared_launch_choices_are_remembered_under_their_own_format(gpu, monkeypatch):
    """x16.prepared_linear tunes under "<fmt>+xpre": its own cache entries, the weight format's variant rules
    and, with tuning off, the weight format's heuristic."""
    h2 = [GemvConfig(32, 16, 2, 1, split=2, h2=True), GemvConfig(64, 16, 4, 1, split=2, h2=True)]
    gpu.times = {h2[0]: 2.0, h2[1]: 1.0}
    key = _key(kernel="nvfp4_gemv_kernel+xpre")
    assert tc.make_key(key, 16, CUDA).fmt == "nvfp4+xpre"
    assert gl.choose_config(key, h2, _run(gpu), CUDA, 16) == (h2[1], True)
    monkeypatch.setattr(gl, "_TUNED", {})
    tc.reset()
    gpu.calls.clear()
    assert gl.choose_config(key, h2, _run(gpu), CUDA, 16) == (h2[1], True) and gpu.calls == []
    assert gl.choose_config(_key(), CANDS, _run(gpu), CUDA, 16)[0] in CANDS     # the plain key is separate
    top = json.loads(tc.SHIPPED_PATH.read_text())["heuristic"]["nvfp4"]["1"][0]
    assert tc.heuristic("nvfp4+xpre", 1, [CANDS[0], GemvConfig(**top, split=3)]) == GemvConfig(**top, split=3)


def test_close_finishers_are_timed_again(gpu, monkeypatch):
    """A candidate that wins the first pass by noise loses the runoff; a clear loser is not timed again."""
    monkeypatch.setattr(gl, "RUNOFF_ROUNDS", 2)
    seq = {CANDS[0]: [1.00, 1.10, 1.12], CANDS[1]: [1.05, 0.97, 0.99], CANDS[2]: [2.0]}

    def run(c):
        gpu.calls.append(c)
        return seq[c][sum(1 for x in gpu.calls if x == c) - 1]
    cfg, _ = gl.choose_config(_key(N=1000), CANDS, run, CUDA, 16)
    assert cfg == CANDS[1] and gpu.calls.count(CANDS[2]) == 1 and gpu.calls.count(CANDS[0]) == 3
    assert dict(gl.tuning_log()[_key(N=1000)])[CANDS[1]] == 0.97


def test_prepared_launch_is_skipped_where_the_plain_one_is_remembered_faster(gpu):
    from types import SimpleNamespace

    from ninfer_kernels import x16
    gpu.name = "Made-up GPU"                 # no shipped entries: only what is recorded here
    qw = SimpleNamespace(fmt="nvfp4", shape=(4096, 5120), cache={})

    def remember(T, plain_ms, prep_ms):
        for name, ms in (("nvfp4_gemv_kernel", plain_ms), ("nvfp4_gemv_kernel+xpre", prep_ms)):
            if ms is not None:
                tc.record(tc.make_key(gl.tune_key(name, 4096, 320, T, torch.bfloat16, False, CUDA), 16, CUDA),
                          CANDS[0], ms)
    remember(4, 0.025, 0.027)                # plain remembered 8 % faster
    remember(2, 0.025, 0.022)
    remember(8, 0.025, 0.0253)               # within the margin: prepared
    remember(1, None, 0.02)                  # only one side known: prepared
    assert not x16.prefer_prepared(qw, 4, torch.bfloat16, False, CUDA)
    assert x16.prefer_prepared(qw, 2, torch.bfloat16, False, CUDA)
    assert x16.prefer_prepared(qw, 8, torch.bfloat16, False, CUDA)
    assert x16.prefer_prepared(qw, 1, torch.bfloat16, False, CUDA)
    assert x16.prefer_prepared(qw, 4, torch.bfloat16, False, torch.device("cpu"))
    assert qw.cache["xpre.prefer"][(4, torch.bfloat16, False, CUDA)] is False     # decided once per weight and T


def test_shipped_h200_table_decides_prepared_vs_plain():
    """The shipped table holds both formats' times for the H200 shapes; remembered_ms reads them."""
    tc.reset()
    tc._USER = {}
    ship = json.loads(tc.SHIPPED_PATH.read_text())["gpus"]["NVIDIA H200"]
    e = next(e for e in ship if e["fmt"] == "nvfp4+xpre")
    key = tc.TuneKey("NVIDIA H200", "9.0", "any", "nvfp4+xpre", e["N"], e["K"], e["t_bucket"], "torch.bfloat16", True)
    assert tc.remembered_ms(key) == pytest.approx(e["us"] / 1e3)
    assert tc.remembered_ms(tc.TuneKey(**{**vars(key), "N": 7})) is None
    tc.reset()
