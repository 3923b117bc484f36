"""ninfer_rt.loader: artifact -> bound weights; checksum, TP-set and inventory errors name what is wrong."""
from __future__ import annotations

import os

import pytest
import torch
from hf_tiny import (CHAT_TEMPLATE, artifact_tensors, artifact_weights, build_hf_model, make_tiny_artifact,
                     model_config_from_hf)

from ninfer_formats import codecs
from ninfer_formats.errors import LoadError
from ninfer_rt.backends.torch_ops import TorchOps
from ninfer_rt.loader import load
from ninfer_rt.model import Model, MtpInput, SeqInput
from ninfer_rt.weights import QWeight
from numerics import rel
from container_util import flip_tensor_bit

# same weights, same math: only the binding differs
EXACT_TOL = 1e-6
# our fp32 model vs transformers' fp32 forward (as in test_model_vs_hf)
HF_TOL = 1e-4




@pytest.fixture(scope="module")
def tiny():
    return build_hf_model(seed=5)


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 246, (21,), generator=torch.Generator().manual_seed(2))


def _logits(cfg, weights, ids):
    m = Model(cfg, weights, TorchOps())
    st = m.new_state()
    out = m.forward([SeqInput(ids, st)])
    mtp = m.mtp_forward([MtpInput(ids[1:], out.hidden[:-1], st.mtp)])
    return out.logits, mtp.logits


def test_plain_roundtrip_matches_direct_weights(tiny, ids, tmp_path):
    make_tiny_artifact(tmp_path, tiny)
    lm = load(tmp_path)
    cfg = model_config_from_hf(tiny.text_config)
    assert lm.config == cfg and lm.rank == 0 and lm.tp_size == 1
    assert isinstance(lm.weights["layers.0.mlp.down_proj.weight"], QWeight)
    assert lm.weights["layers.0.linear_attn.A_log"].dtype == torch.float32
    for got, ref in zip(_logits(lm.config, lm.weights, ids), _logits(cfg, artifact_weights(tiny), ids)):
        assert rel(got, ref) <= EXACT_TOL
    assert lm.chat_template == CHAT_TEMPLATE
    assert lm.generation_config["eos_token_id"] == [248, 246]
    assert '"<|im_end|>"' in lm.tokenizer and lm.identity["source"] == "hf_tiny"
    lm.close()


def test_bf16_activation_dtype(tiny, tmp_path):
    make_tiny_artifact(tmp_path, tiny)
    lm = load(tmp_path / "model.tp1-rank0.ninfer", dtype=torch.bfloat16)
    assert lm.weights["embed_tokens.weight"].dtype == torch.bfloat16
    assert lm.weights["layers.0.mlp.up_proj.weight"].data["w"].dtype == torch.bfloat16
    assert lm.weights["norm.weight"].dtype == torch.float32
    m = Model(lm.config, lm.weights, TorchOps(), dtype=torch.bfloat16, consume_weights=True)
    assert lm.weights == {}                          # every entry now lives (fused) in the model only
    out = m.forward([SeqInput(torch.arange(5), m.new_state())])
    assert out.logits.dtype == torch.bfloat16 and torch.isfinite(out.logits).all()
    with pytest.raises(LoadError, match="dtype"):
        load(tmp_path, dtype=torch.int8)


def test_quantized_formats_bind_like_their_decode(tiny, ids, tmp_path):
    """nvfp4 (fused groups, shared global scale) and f8 rows: same result as decoding every tensor first."""
    ranks = artifact_tensors(tiny, quant=True)
    make_tiny_artifact(tmp_path, tiny, ranks=ranks)
    lm = load(tmp_path)
    q = lm.weights["layers.3.self_attn.q_proj.weight"]
    assert q.fmt == "nvfp4" and q.data["codes"].shape == (256, 32)
    assert lm.weights["layers.0.linear_attn.out_proj.weight"].fmt == "f8_e4m3_row"
    decoded = {n: torch.from_numpy(codecs.decode(f, d, s)) for n, (f, s, d) in ranks[0].items()}
    for got, ref in zip(_logits(lm.config, lm.weights, ids), _logits(lm.config, decoded, ids)):
        assert rel(got, ref) <= EXACT_TOL


def test_nvfp4_fusion_needs_equal_global_scales(tiny):
    ws = artifact_weights(tiny)
    parts = []
    for n in ("layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight"):
        codes, scales, s2 = codecs.nvfp4.quantize(ws[n].numpy())       # each its own scale
        parts.append(QWeight("nvfp4", ws[n].shape, {"codes": torch.from_numpy(codes),
                                                    "scales": torch.from_numpy(scales), "gscale": float(s2)}, n))
    with pytest.raises(LoadError, match="global scales differ"):
        QWeight.concat_rows(parts)




def test_checksum_mismatch_refuses_to_load(tiny, tmp_path):
    (path,) = make_tiny_artifact(tmp_path, tiny)
    flip_tensor_bit(path, "layers.2.mlp.up_proj.weight", byte=3, mask=0x40)
    with pytest.raises(LoadError, match=r"layers\.2\.mlp\.up_proj\.weight: checksum mismatch"):
        load(tmp_path)
    good_dir = tmp_path / "good"
    make_tiny_artifact(good_dir, tiny)
    unverified, good = load(tmp_path, verify=False), load(good_dir)    # explicit opt-out still binds everything
    assert set(unverified.weights) == set(good.weights) and "layers.2.mlp.up_proj.weight" in unverified.weights


@pytest.mark.parametrize("edit, message", [
    ("drop", r"tensor layers\.1\.mlp\.up_proj\.weight: missing"),
    ("extra", r"tensor layers\.9\.bogus\.weight: unexpected"),
    ("reshape", r"tensor layers\.1\.mlp\.up_proj\.weight: shape \[96, 64\].*expected \[128, 64\]"),
    ("visual", r"tensor visual\.blocks\.0\.norm1\.weight: unexpected .*no vision tower"),
], ids=["missing", "unexpected", "misshaped", "vision-without-config"])
def test_inventory_errors_name_the_tensor(tiny, tmp_path, edit, message):
    ranks = artifact_tensors(tiny)
    t = ranks[0]
    name = "layers.1.mlp.up_proj.weight"
    if edit == "drop":
        del t[name]
    elif edit == "extra":
        t["layers.9.bogus.weight"] = ("f32", (3,), codecs.encode("f32", torch.ones(3).numpy()))
    elif edit == "reshape":
        t[name] = ("f32", (96, 64), codecs.encode("f32", torch.ones(96, 64).numpy()))
    else:
        t["visual.blocks.0.norm1.weight"] = ("f32", (8,), codecs.encode("f32", torch.ones(8).numpy()))
    make_tiny_artifact(tmp_path, tiny, ranks=ranks)
    with pytest.raises(LoadError, match=message):
        load(tmp_path)


def test_tp_set_checks(tiny, tmp_path):
    paths = make_tiny_artifact(tmp_path / "tp2", tiny, tp=2)
    lm = load(tmp_path / "tp2", rank=1)
    assert lm.tp_size == 2 and lm.rank == 1
    assert lm.weights["layers.3.self_attn.q_proj.weight"].shape == (128, 64)       # 2 of 4 heads x [q|gate]
    assert lm.weights["layers.0.linear_attn.conv1d.weight"].shape == (128 // 2, 4)   # C = 2*32 + 64
    assert lm.weights["lm_head.weight"].shape == (128, 64)
    with pytest.raises(LoadError, match="packed for TP2, but TP4"):
        load(paths[0], tp_size=4)
    with pytest.raises(LoadError, match="is rank 0, but rank 1"):
        load(paths[0], rank=1)
    with pytest.raises(LoadError, match="no .ninfer rank files for TP4"):
        load(tmp_path / "tp2", tp_size=4)
    make_tiny_artifact(tmp_path / "other", build_hf_model(seed=6), tp=2)
    os.replace(tmp_path / "other" / "model.tp2-rank1.ninfer", paths[1])
    with pytest.raises(LoadError, match="mixed TP set"):
        load(tmp_path / "tp2", rank=0)
    os.remove(paths[1])
    with pytest.raises(LoadError, match="incomplete TP set: rank 1"):
        load(paths[0])
    with pytest.raises(LoadError, match="rank 1 file model.tp2-rank1.ninfer is missing"):
        load(tmp_path / "tp2", rank=1)
    with pytest.raises(LoadError, match="no such file"):
        load(tmp_path / "nowhere")


def test_packer_output_loads_and_matches_hf(tmp_path, ids):
    """End to end: HF folder -> ninfer-pack convert (bf16 recipe) -> load -> logits == HF's (fp32 math)."""
    import copy

    from hf_tiny import load_hf_reference, make_tiny_checkpoint

    from ninfer_pack.convert import convert
    make_tiny_checkpoint(tmp_path / "hf", seed=8, dtype=torch.bfloat16)
    convert(str(tmp_path / "hf"), tmp_path / "out", recipe="bf16", tp=1, jobs=1, progress=False)
    lm = load(tmp_path / "out")
    hf = copy.deepcopy(load_hf_reference(tmp_path / "hf").causal_lm()).float()
    logits, _ = _logits(lm.config, lm.weights, ids)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    assert rel(logits, ref) <= HF_TOL
