"""bench/decode.py --tp 1,2: a CPU dry run over gloo (tiny synthetic model) measures both TP sizes in one run
and writes the TP fields (all-reduce count and cost, per-rank memory, forced process-group pass, TP1
comparison); the report side on made-up records; the collective counter; followers never start children;
a budget stop or a cut-off precompile leaves no process behind; bad arguments are one-line errors, and a run
that measured nothing leaves the results file alone."""
from __future__ import annotations

import json
import math
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time

import pytest
import torch

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
sys.path.append(BENCH)
import decode
import decode_measure
import decode_profile
import decode_rank
import decode_report as report
import decode_tp
import synth_artifact as synth

from ninfer_formats.errors import NinferError
from ninfer_kernels.gemv_split import SPLIT_UNROLL, split_arrive_sem
from ninfer_rt.tp_group import LocalGroup

REQUIRED = ("recipe", "tp", "context", "draft_tokens", "tok_s", "ms_step", "bytes_step", "pct_roofline",
            "copy_tbps", "gpu")
CONTEXT = 40
REL_TOL = 1e-9          # fields derived from other fields of the same run: equal up to float rounding


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("decode-tp")
    out = tmp / "decode.json"
    cmd = [sys.executable, os.path.join(BENCH, "decode.py"), "--device", "cpu", "--tiny", "--backend", "torch",
           "--tp", "1,2", "--recipes", "bf16", "--parts", "decode,verify", "--contexts", str(CONTEXT),
           "--steps", "3", "--warm", "1", "--max-draft", "3", "--copy-mb", "8", "--matmul-n", "64",
           "--compare-allreduce", "always", "--dir", str(tmp / "art"), "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(out.read_text()), p.stdout, tmp


def _one(records, **want):
    found = [r for r in records if all(r.get(k) == v for k, v in want.items())]
    assert len(found) == 1, (want, found)
    return found[0]


def _main_decode(records, tp):
    """The decode record of the runtime's own all-reduce choice (TP1 has no all-reduce fields)."""
    return _one(records, kind="decode", tp=1) if tp == 1 else _one(records, kind="decode", tp=tp,
                                                                    allreduce_forced=False)


def test_both_tp_sizes_in_one_run(dry_run):
    records, stdout, tmp = dry_run
    assert not [r for r in records if r["kind"] in ("error", "skipped")]
    for tp in (1, 2):
        dec = _main_decode(records, tp)
        for k in REQUIRED:
            assert k in dec, (tp, k)
        assert dec["context"] == CONTEXT and dec["draft_tokens"] == 0 and dec["recipe"] == "bf16"
        assert dec["split_unroll"] == SPLIT_UNROLL.value      # the split-K reduction the run compiled
        assert dec["split_arrive"] == split_arrive_sem()
        assert math.isfinite(dec["tok_s"]) and dec["tok_s"] > 0 and dec["ms_step"] > 0
        assert {r["draft_tokens"] for r in records if r["kind"] == "verify" and r["tp"] == tp} == {1, 2, 3}
    tp1, tp2 = _main_decode(records, 1), _main_decode(records, 2)
    assert tp2["weight_bytes"] < tp1["weight_bytes"]            # bytes/step are per GPU: rank 0's shard
    assert "allreduce" not in tp1 and "speedup_vs_tp1" not in tp1
    assert tp1["ms_step"] == tp1["ms_step_ahead"] and tp2["ms_step"] == tp2["ms_step_sync"]   # as the engine runs
    assert all(r[k] > 0 for r in (tp1, tp2) for k in ("ms_step_ahead", "ms_step_sync", "ms_step_gpu"))
    assert tp2["tok_s_tp1"] == tp1["tok_s"]
    assert math.isclose(tp2["speedup_vs_tp1"], tp2["tok_s"] / tp1["tok_s"], rel_tol=REL_TOL)
    k3 = _one(records, kind="verify", tp=2, draft_tokens=3)
    assert k3["verify_ratio_tp1"] == _one(records, kind="verify", tp=1, draft_tokens=3)["verify_ratio"]
    for v in (r for r in records if r["kind"] == "verify"):             # the tiny model has an MTP module
        assert all(k in v for k in REQUIRED), v
        # interleaved rounds: the ratio is the median of the per-round ratios, the times the median rounds
        ratios = [a / b for a, b in zip(v["ms_step_rounds"], v["ms_step_k0_rounds"])]
        assert len(ratios) == decode_measure.VERIFY_ROUNDS and v["verify_ratio_rounds"] == ratios
        assert v["verify_ratio"] == statistics.median(ratios) and v["ms_step"] == statistics.median(v["ms_step_rounds"])
        # the same steps without a read-back each (the GPU's time), and the host's part of a synced step
        assert v["ms_step_gpu"] > 0 and v["ms_step_k0_gpu"] > 0 and v["host_ms"] > 0 and v["host_ms_k0"] > 0
        assert v["verify_ratio_gpu"] > 0
        want = decode_measure.spec_tok_s(v["ms_step"], v["draft_ms"], v["draft_tokens"], 0.75)[1]
        assert math.isclose(v["tok_s"], want, rel_tol=REL_TOL)
        # the drafts as the engine runs greedy ones: the argmax fed back on the device
        want = decode_measure.spec_tok_s(v["ms_step"], v["draft_ms_chained"], v["draft_tokens"], 0.75)[1]
        assert v["draft_ms_chained"] > 0 and math.isclose(v["tok_s_chained"], want, rel_tol=REL_TOL)
    assert "tp: bf16 TP2 @40:" in stdout
    assert "; gpu " in stdout and "host " in stdout
    assert not list((tmp / "art").rglob("*.ninfer"))             # artifacts removed without --keep


def test_tp2_allreduce_fields(dry_run):
    records = dry_run[0]
    ar = _one(records, kind="allreduce", tp=2)
    layers = synth.TINY.layers
    assert ar["allreduce"] == "gloo" and ar["allreduce_calls_per_step"] == 2 * layers   # attention/GDN + MLP
    assert ar["allgathers_per_step"] == 1                                                 # vocab-parallel logits
    (msg,) = ar["allreduce_messages"]
    assert msg["shape"] == [1, synth.TINY.hidden] and msg["bytes"] == 4 * synth.TINY.hidden   # fp32 on CPU
    per_call, per_step = ar["allreduce_us_per_call"]["gloo"], ar["allreduce_us_per_step"]["gloo"]
    assert per_call > 0 and math.isclose(per_step, 2 * layers * per_call, rel_tol=REL_TOL)
    for forced in (False, True):
        dec = _one(records, kind="decode", tp=2, allreduce_forced=forced)
        assert dec["allreduce"] == "gloo" and dec["allreduce_calls_per_step"] == 2 * layers
        assert math.isclose(dec["allreduce_pct_step"], 100 * per_step / 1e3 / dec["ms_step"], rel_tol=REL_TOL)
        assert set(dec["ms_step_by_allreduce"]) == {"gloo", "gloo forced"}
    assert dec["ms_step_by_allreduce"]["gloo forced"] == dec["ms_step"]


def test_memory_per_rank(dry_run):
    records = dry_run[0]
    for tp in (1, 2):
        rss = _one(records, kind="load", tp=tp)["peak_rss_gib"]
        assert len(rss) == tp and all(0 < v < 64 for v in rss)
        assert _main_decode(records, tp)["peak_rss_gib"] == rss           # carried by the later records


def _dec(tp, ctx, tok_s, impl=None, forced=False):
    r = {"kind": "decode", "recipe": "nvfp4", "tp": tp, "context": ctx, "draft_tokens": 0, "tok_s": tok_s,
         "tok_s_gpu": tok_s * 1.1, "ms_step": 1e3 / tok_s, "pct_roofline": tok_s / 4}
    if impl:
        r.update(allreduce=impl, allreduce_forced=forced, allreduce_us_per_step={"one_shot": 900.0, "nccl": 2200.0})
    return r


def test_compare_tp_on_made_up_records():
    recs = [_dec(1, 1024, 97.0), _dec(1, 4096, 90.0), _dec(2, 1024, 151.0, "one_shot"),
            _dec(2, 1024, 121.0, "nccl", forced=True), _dec(2, 4096, 140.0, "one_shot")]
    report.compare_tp(recs)
    fast, slow, other = recs[2], recs[3], recs[4]
    assert fast["tok_s_tp1"] == 97.0 and math.isclose(fast["speedup_vs_tp1"], 151.0 / 97.0, rel_tol=REL_TOL)
    assert math.isclose(slow["speedup_vs_tp1_gpu"], 121.0 / 97.0, rel_tol=REL_TOL)
    assert fast["tok_s_by_allreduce"] == slow["tok_s_by_allreduce"] == {"one_shot": 151.0, "nccl": 121.0}
    assert other["tok_s_tp1"] == 90.0 and other["ms_step_by_allreduce"] == {"one_shot": 1e3 / 140.0}
    lines = report.tp_summary(recs)
    assert len(lines) == 2 and "= 1.56x" in lines[0] and "with nccl: 121.0 tok/s" in lines[0]
    assert sum("TP2 decode @1024" in g for g in report.goals(recs)) == 1      # the forced pass is no goal line


def test_collective_counter_counts_and_restores():
    g = LocalGroup()
    x = torch.randn(3, 7)
    with decode_tp.CollectiveCounter(g) as c:
        for _ in range(3):
            assert g.all_reduce(x) is x
        g.all_reduce(x.to(torch.float64))
        g.all_gather_last(x)
    assert c.messages == {((3, 7), torch.float32): 3, ((3, 7), torch.float64): 1} and c.gathers == 1
    assert "all_reduce" not in vars(g) and "all_gather_last" not in vars(g)


@pytest.mark.parametrize("kw,needle", [
    ({"compare_allreduce": "sometimes"}, "compare_allreduce"),
    ({"steps": 0}, "steps: 0"),
    ({"warm": -1}, "warm: -1"),
    ({"prefill_chunk": -4}, "prefill_chunk: -4"),
    ({"contexts": (64,), "verify_contexts": (32,)}, "verify_contexts"),
], ids=["compare-mode", "no-steps", "negative-warm", "negative-chunk", "verify-outside-contexts"])
def test_bench_options_validated_on_creation(kw, needle):
    with pytest.raises(NinferError, match=needle):
        decode_rank.BenchOptions(**kw)


@pytest.mark.parametrize("argv,needle", [
    (["--steps", "-3"], "argument --steps: expected a positive integer, got '-3'"),
    (["--warm", "x"], "argument --warm: expected an integer >= 0"),
    (["--tp", "1,x"], "argument --tp: expected comma-separated integers"),
    (["--parts", "decode,nope"], "argument --parts: expected a comma-separated subset"),
], ids=["negative-steps", "warm-not-int", "tp-not-int", "unknown-part"])
def test_bad_arguments_are_one_line_errors(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        decode.parse_args(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: ") and needle in err and err.count("\n") == 1, err


def test_options_keep_given_zero_and_check_verify_contexts():
    opts = decode.options(decode.parse_args(["--device", "cpu", "--warm", "0", "--contexts", "64,128",
                                             "--verify-contexts", "128"]))
    assert opts["warm"] == 0 and opts["verify_contexts"] == (128,)        # not the default 16
    with pytest.raises(NinferError, match="--verify-contexts 32"):
        decode.options(decode.parse_args(["--device", "cpu", "--contexts", "64", "--verify-contexts", "32"]))


def test_nothing_measured_leaves_results_alone(tmp_path, capsys):
    """A run whose every measurement was skipped (budget) must not replace earlier results with nothing."""
    out = tmp_path / "decode.json"
    out.write_text("[]")
    rc = decode.main(["--device", "cpu", "--tiny", "--recipes", "bf16", "--budget-s", "1", "--dir",
                      str(tmp_path / "art"), "--out", str(out)])
    assert rc == 1 and out.read_text() == "[]"
    assert "left as it was" in capsys.readouterr().err


def _daemon_precompile(q):
    q.put(decode_rank._precompile(None, decode_rank.BenchOptions(), torch.device("cuda")))


def test_daemonic_follower_skips_precompile(monkeypatch):
    """TP followers are daemonic (tp.launch): a precompile subprocess there crashed the rank on 2xH200."""
    monkeypatch.delenv("NINFER_GEMV_TUNE", raising=False)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_daemon_precompile, args=(q,), daemon=True)
    p.start()
    try:
        assert q.get(timeout=120) is None
    finally:
        p.join(30)
    assert p.exitcode == 0


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="lists process group members through /proc")
def test_budget_stop_leaves_no_rank_behind(tmp_path, monkeypatch):
    """A TP2 measurement stopped by the time budget takes its follower rank with it (own process group)."""
    args = decode.parse_args(["--device", "cpu", "--tiny", "--backend", "torch", "--tp", "2", "--steps", "1000000",
                              "--contexts", "24", "--parts", "decode", "--copy-mb", "8", "--matmul-n", "64"])
    opts = {**decode.options(args), "tp": 2}
    paths, info = synth.build(str(tmp_path / "art"), synth.TINY, "bf16", 2, workers=1)
    seen, real_end = [], decode._end_group
    monkeypatch.setattr(decode, "_end_group", lambda p: (seen.append((p.pid, _members(p.pid))), real_end(p)))
    records, error = decode.run_child(opts, "bf16", paths, info, time.monotonic() + 8)
    assert error == "stopped: time budget exhausted"
    assert "decode" not in {r["kind"] for r in records}            # stopped inside the endless decode loop
    pgid, before = seen[0]
    assert pgid in before and len(before) >= 2, before               # rank 0 leads a group its follower is in
    deadline = time.monotonic() + 10                                 # killed ranks are reaped by init
    while _members(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _members(pgid)


def _members(pgid: int) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.getpgid(int(name)) == pgid:
                    out.append(int(name))
            except ProcessLookupError:
                pass
    return out


def _pool_sleeper(pid_file: str) -> None:
    """A stand-in for bench/kernels.py's precompile: a worker pool busy far past the time limit."""
    with mp.get_context("fork").Pool(2) as pool:
        with open(pid_file, "w") as f:
            f.write(" ".join(str(w.pid) for w in pool._pool))
        pool.map(time.sleep, [120, 120])


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"        # exited, not yet reaped
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="checks the pool workers through /proc")
def test_cut_off_precompile_takes_its_workers(tmp_path):
    """The precompile's time limit ends its pool workers too (they would compile on while decode is timed)."""
    pid_file = tmp_path / "pids"
    assert decode_rank.run_limited(_pool_sleeper, (str(pid_file),), timeout_s=6.0) is None
    pids = [int(p) for p in pid_file.read_text().split()]
    assert len(pids) == 2
    deadline = time.monotonic() + 5
    while not all(map(_gone, pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(map(_gone, pids)), pids


def test_profile_steps_on_cpu(monkeypatch):
    """decode_rank._profile (GPU-only in a run) on CPU with the profiler stubbed: the decode, batch-4 and K=3
    verify steps run, each leaves a tagged record, the extra states are freed and the state is rewound."""
    from hf_tiny import build_hf_model, loaded_model

    from ninfer_rt.backends.torch_ops import TorchOps
    from ninfer_rt.graphs import GraphConfig, GraphRunner
    from ninfer_rt.model import Model
    from ninfer_rt.state import CacheConfig
    lm = loaded_model(build_hf_model(seed=1))
    model = Model(lm.config, lm.weights, TorchOps(), cache=CacheConfig(num_pages=64, page_size=16, max_seqs=6))
    runner = GraphRunner(model, GraphConfig(batch_sizes=(1,), tokens=(1, 2, 3, 4), mtp_tokens=(), kv_buckets=(256,),
                                            eager=True))
    calls = []

    def fake_profile(step, steps, top=15, linear_labels=None):
        assert linear_labels[-1] == "lm_head" and len(linear_labels) == 4 * model.cfg.num_hidden_layers + 1
        for _ in range(2):
            step()
        calls.append(1)
        return {"kernels_per_step": 1.0, "kernel_us_per_step": 1.0, "us_by_group": {"linear": 1.0}, "top": []}
    monkeypatch.setattr(decode_measure, "kernel_profile", fake_profile)
    st = model.new_state()
    decode_measure.fill_context(model, st, 40)
    free = model.kv_pool.free_pages()
    recs = []
    decode_profile.profile(model, runner, st, 40, decode_rank.BenchOptions(device="cpu"), {"recipe": "x"}, recs.append)
    assert [r["step"] for r in recs] == ["decode", "batch 4", "verify K=3"] and len(calls) == 3
    assert recs[0]["source"] == "graph replay" and recs[1]["source"].startswith("eager")    # batch 4: no graph
    assert recs[1]["batch"] == 4 and recs[2]["draft_tokens"] == 3 and all("note" not in r for r in recs)
    assert st.length == 40 and model.kv_pool.free_pages() == free
    assert all(report.row({**r, "tp": 1}) for r in recs)


class _Ev:
    def __init__(self, name, start, end):
        self.name = name
        self.time_range = type("R", (), {"start": start, "end": end})()


def test_exclusive_profile_shares_overlaps_and_counts_idle():
    """Kernels that start early (PDL) and wait get only the part of the timeline where they ran last; gaps
    between kernels are idle; two steps halve everything."""
    evs = [_Ev("a", 0, 10), _Ev("b", 4, 15), _Ev("c", 20, 24), _Ev("d", 21, 23),   # d entirely inside c
           _Ev("a", 30, 40), _Ev("b", 34, 45), _Ev("c", 50, 54), _Ev("d", 51, 53)]
    excl, idle = decode_measure._exclusive(list(reversed(evs)), steps=2)
    assert excl == {"a": 10.0, "b": 5.0, "c": 4.0, "d": 0.0}
    assert idle == (5 + 6 + 5) / 2
    assert sum(excl.values()) + idle == (54 - 0) / 2


def test_idle_by_transition_names_the_kernels_around_each_gap():
    """Each gap goes to (the kernel that ended last -> the next to start), per step, largest first; d, which ends
    inside c, is not the kernel in front of the next gap."""
    evs = [_Ev("a", 0, 10), _Ev("b", 4, 15), _Ev("c", 20, 24), _Ev("d", 21, 23),
           _Ev("a", 30, 40), _Ev("b", 34, 45), _Ev("c", 50, 54), _Ev("d", 51, 53)]
    top = decode_measure.idle_by_transition(list(reversed(evs)), steps=2)
    assert top == [["c -> a", 3.0, 0.5], ["b -> c", 5.0, 1.0]][::-1]
    line = report.row({"kind": "profile", "recipe": "nvfp4", "tp": 1, "context": 8, "step": "decode",
                       "kernels_per_step": 4, "kernel_us_per_step": 20.0, "source": "graph replay",
                       "us_by_group": {"linear": 20.0}, "excl_us_by_group": {"linear": 18.0},
                       "idle_us_per_step": 8.0, "idle_top": top})
    assert "(b -> c 5 us/1, c -> a 3 us/0.5)" in line


def test_linear_by_shape_names_gemvs_by_launch_order():
    """A step's GEMV launches take the labels in order (other kernels skipped); a count that does not match the
    labels gives a note instead of a wrong attribution."""
    evs = [_Ev("nvfp4_h2_gemv_kernel", 0, 10), _Ev("rmsnorm_kernel", 10, 12), _Ev("nvfp4_h2_gemv_kernel", 11, 20),
           _Ev("q6_k_h2_gemv_kernel", 20, 30)]
    evs += [_Ev(e.name, e.time_range.start + 100, e.time_range.end + 100) for e in evs]
    by = decode_measure.linear_by_shape(list(reversed(evs)), 2, ["qkv", "o", "lm_head"])
    assert by == {"qkv": [10.0, 10.0, 1.0], "o": [9.0, 8.0, 1.0], "lm_head": [10.0, 10.0, 1.0]}
    assert "note" in decode_measure.linear_by_shape(evs, 2, ["qkv", "lm_head"])
    line = report.row({"kind": "profile", "recipe": "nvfp4", "tp": 1, "context": 8, "step": "decode",
                       "kernels_per_step": 4, "kernel_us_per_step": 30.0, "source": "graph replay",
                       "us_by_group": {"linear": 29.0}, "linear_by_shape": by})
    assert "qkv 10.0/10.0 (10)" in line and "o 9.0/8.0 (8)" in line


def test_profile_line_shows_exclusive_groups():
    r = {"kind": "profile", "recipe": "nvfp4", "tp": 1, "context": 1024, "step": "decode", "kernels_per_step": 3,
         "kernel_us_per_step": 30.0, "source": "graph replay", "us_by_group": {"linear": 20.0, "norms": 10.0},
         "excl_us_by_group": {"linear": 18.0, "norms": 7.0}, "idle_us_per_step": 2.0}
    line = report.row(r)
    assert "exclusive: linear 18, norms 7, idle 2" in line and "linear 20, norms 10" in line


def test_precompile_process_does_not_force_tuning():
    """bench/kernels.py makes an unset NINFER_GEMV_TUNE mean `force` (it times every candidate); the decode
    bench's precompile process, which used to import it, must compile only what the run launches."""
    code = ("import os, sys; sys.path.insert(0, sys.argv[1]); os.environ.pop('NINFER_GEMV_TUNE', None)\n"
            "import decode_rank; decode_rank._precompile_proc([], 1)\n"
            "from ninfer_kernels import gemv_launch; print('mode', gemv_launch.tune_mode())")
    env = {k: v for k, v in os.environ.items() if k != "NINFER_GEMV_TUNE"}
    out = subprocess.run([sys.executable, "-c", code, BENCH], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "mode 1" in out.stdout
