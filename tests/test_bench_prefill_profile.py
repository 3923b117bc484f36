"""bench/prefill_profile.py: kernel attribution and extrapolation on made-up events, and a CPU dry run of the
whole script on the tiny synthetic model (torch backend, two chunks)."""
from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.append(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import prefill_breakdown as PB
import prefill_profile
import prefill_report as R

SUM_TOL = 1e-6          # relative: sums of the same numbers in another order


@pytest.mark.parametrize("name,op,want", [
    ("nvjet_tst_256x128_64x4_2x1_v_bz_coopB_TNT", "linear", "linear_gemm"),
    ("nvfp4_dequant_kernel", "linear", "dequant"),
    ("void at::native::vectorized_elementwise_kernel<4, add>", "linear", "elementwise_copies"),
    ("chunk_gated_delta_rule_fwd_kernel_h_blockdim64", "gdn_chunk", "gdn_chunk"),
    ("Memcpy DtoD (Device -> Device)", "gdn_chunk", "elementwise_copies"),
    ("attn_fwd_kernel", "attention", "attention"),
    ("pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<256>>", None, "attention"),
    ("causal_conv_kernel", "causal_conv", "conv"),
    ("rmsnorm_kernel", "add_rmsnorm", "norms"),
    ("kv_write_kernel", "kv_write", "kv_write"),
    ("rope_kernel", "qk_norm_rope_store", "rope"),
    ("void at::native::index_copy_kernel", "qk_norm_rope_store", "kv_write"),
    ("pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<256>>", "gated_attention", "attention"),
    ("sigmoid_mul_kernel", "gated_attention", "elementwise_copies"),
    ("indexSelectLargeIndex", "embedding", "embedding"),
    ("recompute_w_u_fwd_kernel", None, "gdn_chunk"),
    ("void at::native::index_elementwise_kernel", None, "elementwise_copies"),
    ("some_unknown_kernel", None, "other"),
], ids=lambda v: str(v)[:24])
def test_category(name, op, want):
    assert PB.category(name, op) == want


def _events():
    """Two GDN layers, one attention layer, a head; one kernel outside every range."""
    sections = [("setup", 0.0, 10.0), ("embed", 10.5, 20.0), ("layer:0:gdn", 21.0, 121.0),
                ("layer:1:gdn", 122.0, 222.0), ("layer:2:attn", 223.0, 423.0), ("head", 424.0, 454.0)]
    ops = [("linear", 22.0, 60.0), ("gdn_chunk", 61.0, 110.0), ("linear", 123.0, 160.0),
           ("gdn_chunk", 161.0, 215.0), ("linear", 224.0, 300.0), ("attention", 301.0, 400.0),
           ("linear", 425.0, 450.0)]
    kernels = [("emb", 11.0, 3.0), ("gemm", 25.0, 30.0), ("chunk_fwd_kernel_o", 62.0, 40.0),
               ("Memcpy DtoD", 103.0, 5.0), ("rmsnorm_kernel", 111.0, 7.0), ("gemm", 125.0, 30.0),
               ("chunk_fwd_kernel_o", 165.0, 43.0), ("gemm", 230.0, 60.0), ("attn_fwd_kernel", 305.0, 90.0),
               ("gemm", 430.0, 17.0), ("stray", 500.0, 2.0)]
    return kernels, sections, ops


def test_attribute_and_summary():
    rows = PB.attribute(*_events())
    by = {(r["name"], r["section"]): r for r in rows}
    assert by[("Memcpy DtoD", "layer:0:gdn")]["category"] == "elementwise_copies"
    assert by[("rmsnorm_kernel", "layer:0:gdn")]["op"] is None
    assert by[("stray", None)]["type"] == "unattributed"
    counts, target = {"gdn": 2, "attn": 1}, {"gdn": 48, "attn": 16}
    s = PB.summarize(rows, counts, target, top=3)
    total = sum(k[2] for k in _events()[0])
    assert s["total_us"] == pytest.approx(total, rel=SUM_TOL)
    want = 3 + 2 + (30 + 40 + 5 + 7 + 30 + 43) * 24 + (60 + 90) * 16 + 17
    assert s["extrapolated_total_us"] == pytest.approx(want, rel=SUM_TOL)
    cats = {r["name"]: r for r in s["categories"]}
    assert cats["gdn_chunk"]["per_gdn_layer_us"] == pytest.approx(41.5, rel=SUM_TOL)
    assert cats["linear_gemm"]["by_type"] == pytest.approx({"gdn": 60.0, "attn": 60.0, "head": 17.0}, rel=SUM_TOL)
    assert sum(r["us"] for r in s["ops"]) == pytest.approx(total, rel=SUM_TOL)
    assert [k["name"] for k in s["top"]] == ["gemm", "attn_fwd_kernel", "chunk_fwd_kernel_o"]


def test_kernel_outside_every_section_is_placed_by_its_launch():
    sections, ops = [("layer:0:gdn", 0.0, 50.0), ("layer:1:attn", 60.0, 90.0)], [("attention", 61.0, 89.0)]
    kernels = [("attn_fwd_kernel", 95.0, 4.0, 70.5), ("late_no_launch", 95.0, 4.0, None), ("gemm", 10.0, 5.0, 2.0)]
    rows = PB.attribute(kernels, sections, ops)
    assert [(r["section"], r["op"]) for r in rows] == [("layer:1:attn", "attention"), (None, None),
                                                      ("layer:0:gdn", None)]


def test_section_totals_and_wall_extrapolation():
    marks = [("setup", 0.0), ("embed", 0.5), ("layer:0:gdn", 1.0), ("layer:1:attn", 3.0), ("head", 7.0),
             ("setup", 7.25), ("embed", 7.5), ("layer:0:gdn", 8.0), ("layer:1:attn", 10.0), ("head", 14.0),
             ("end", 14.5)]
    wall = PB.section_totals(marks)
    assert wall == pytest.approx({"setup": 0.75, "embed": 1.0, "gdn": 4.0, "attn": 8.0, "head": 0.75})
    ext = PB.extrapolated_wall(wall, {"gdn": 1, "attn": 1}, {"gdn": 3, "attn": 1})
    assert ext == pytest.approx(0.75 + 1.0 + 12.0 + 8.0 + 0.75)


@pytest.mark.parametrize("tokens,chunk", [(7, 7), (9, 4), (5, 1)], ids=["one_chunk", "odd_chunks", "per_token"])
def test_attention_flops(tokens, chunk):
    hq, d = 3, 5
    want = sum(4 * hq * d * (i + 1) for i in range(tokens))     # query i sees keys 0..i
    assert R.attention_flops(hq, d, tokens, chunk) == pytest.approx(want)


def test_dry_run_cpu(tmp_path, capsys):
    out = tmp_path / "prof.json"
    rc = prefill_profile.main(["--device", "cpu", "--tiny", "--layers", "4", "--tokens", "48", "--chunk", "32",
                               "--runs", "1", "--top", "5", "--dir", str(tmp_path / "art"), "--out", str(out)])
    assert rc == 0
    recs = json.loads(out.read_text())
    kinds = {r["kind"] for r in recs}
    assert kinds == {"config", "prefill", "layer_type", "category", "op", "kernel"}
    cfg = next(r for r in recs if r["kind"] == "config")
    assert cfg["counts"] == {"gdn": 3, "attn": 1} and cfg["target"] == {"gdn": 48, "attn": 16}
    pf = next(r for r in recs if r["kind"] == "prefill")
    assert pf["tok_s"] > 0 and pf["extrapolated_s"] > pf["s"] and pf["linear_tflop_target"] > pf["linear_tflop"]
    cats = [r for r in recs if r["kind"] == "category"]
    assert sum(r["ms"] for r in cats) == pytest.approx(pf["kernel_ms"], rel=SUM_TOL)
    for r in cats:
        assert sum(r["by_type_ms"].values()) == pytest.approx(r["ms"], rel=SUM_TOL), r["name"]
    assert {"linear_gemm", "gdn_chunk", "attention"} <= {r["name"] for r in cats}
    types = {r["type"]: r for r in recs if r["kind"] == "layer_type"}
    assert types["gdn"]["extrapolated_wall_ms"] == pytest.approx(types["gdn"]["wall_ms"] * 16, rel=SUM_TOL)
    assert len([r for r in recs if r["kind"] == "kernel"]) == 5
    text = capsys.readouterr().out
    assert "extrapolated:" in text and "48 GDN + 16 attention" in text


def test_bad_layout_is_one_line_error(tmp_path, capsys):
    rc = prefill_profile.main(["--device", "cpu", "--tiny", "--layers", "3", "--dir", str(tmp_path)])
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --layers 3 with --full-every 4 has no attn layer to extrapolate 64 layers from"]


@pytest.mark.parametrize("argv,needle", [
    (["--tokens", "0"], "argument --tokens: expected a positive integer, got '0'"),
    (["--runs", "x"], "argument --runs: expected a positive integer, got 'x'"),
    (["--device", "tpu"], "argument --device: invalid choice"),
], ids=["no-tokens", "runs-not-int", "unknown-device"])
def test_bad_arguments_are_one_line_errors(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        prefill_profile.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: ") and needle in err and err.count("\n") == 1, err


class _Ops:
    def __init__(self, name, decided=None):
        self.name, self._decided = name, decided

    def gdn_prefill_impl(self):
        return self._decided


@pytest.mark.parametrize("ops,want", [
    (_Ops("triton", "fla"), "fla chunk_gated_delta_rule"),
    (_Ops("triton", "recurrent"), "triton gdn_recurrent"),
    (_Ops("triton", None), "triton gdn_recurrent"),          # no CUDA prefill chose (CPU / interpreter)
    (_Ops("torch"), "torch reference"),
], ids=["fla", "recurrent", "undecided", "torch"])
def test_gdn_impl_reads_what_the_backend_ran(ops, want):
    assert R.gdn_impl(ops).startswith(want)
