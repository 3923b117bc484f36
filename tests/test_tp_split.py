"""The TP partition table: per-rank shapes of the 27B model (reference §13), head locality, illegal cuts."""
import numpy as np
import pytest

from ninfer_formats.errors import SourceError
from ninfer_formats.model_config import FULL, LINEAR, ModelConfig, VisionConfig
from ninfer_pack.inventory import artifact_shape, expected_shapes
from ninfer_pack.recipes import load_recipe, role_of
from ninfer_pack.tp_split import plan_split, rule_for


def _cfg_27b(**kw):
    base = dict(vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=4,
                num_attention_heads=24, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
                linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128,
                linear_conv_kernel_dim=4, layer_types=[LINEAR] * 3 + [FULL], mtp_num_hidden_layers=1,
                vision=VisionConfig(depth=1, hidden_size=1152, intermediate_size=4304, num_heads=16,
                                    patch_size=16, temporal_patch_size=2, spatial_merge_size=2, in_channels=3,
                                    out_hidden_size=5120, num_position_embeddings=2304))
    base.update(kw)
    return ModelConfig(**base)


C27 = _cfg_27b()

# reference §13 table: (tensor, TP2 per-rank shape, TP4 per-rank shape)
TABLE = [
    ("layers.3.self_attn.q_proj.weight", (6144, 5120), (3072, 5120)),
    ("layers.3.self_attn.k_proj.weight", (512, 5120), (256, 5120)),
    ("layers.3.self_attn.v_proj.weight", (512, 5120), (256, 5120)),
    ("layers.3.self_attn.o_proj.weight", (5120, 3072), (5120, 1536)),
    ("layers.0.linear_attn.in_proj_qkv.weight", (5120, 5120), (2560, 5120)),
    ("layers.0.linear_attn.conv1d.weight", (5120, 4), (2560, 4)),
    ("layers.0.linear_attn.in_proj_z.weight", (3072, 5120), (1536, 5120)),
    ("layers.0.linear_attn.in_proj_a.weight", (24, 5120), (12, 5120)),
    ("layers.0.linear_attn.in_proj_b.weight", (24, 5120), (12, 5120)),
    ("layers.0.linear_attn.A_log", (24,), (12,)),
    ("layers.0.linear_attn.dt_bias", (24,), (12,)),
    ("layers.0.linear_attn.out_proj.weight", (5120, 3072), (5120, 1536)),
    ("layers.0.mlp.gate_proj.weight", (8704, 5120), (4352, 5120)),
    ("layers.0.mlp.up_proj.weight", (8704, 5120), (4352, 5120)),
    ("layers.0.mlp.down_proj.weight", (5120, 8704), (5120, 4352)),
    ("lm_head.weight", (124160, 5120), (62080, 5120)),
    ("embed_tokens.weight", (248320, 5120), (248320, 5120)),
    ("layers.0.linear_attn.norm.weight", (128,), (128,)),
    ("layers.3.self_attn.q_norm.weight", (256,), (256,)),
    ("mtp.fc.weight", (5120, 10240), (5120, 10240)),
    ("mtp.layers.0.self_attn.q_proj.weight", (6144, 5120), (3072, 5120)),
    ("mtp.layers.0.mlp.down_proj.weight", (5120, 8704), (5120, 4352)),
    ("visual.blocks.0.attn.qkv.weight", (3456, 1152), (3456, 1152)),
]


def _shape(name):
    return artifact_shape(name, expected_shapes(C27)[name])


def _assert_tiles(s, shape, tp):
    """The runs of all ranks tile the split dim exactly once, each rank getting rank_shape's share."""
    covered = np.zeros(shape[s.dim], np.int32)
    for runs in s.ranges:
        assert sum(b - a for a, b in runs) == s.rank_shape[s.dim]
        for a, b in runs:
            covered[a:b] += 1
    assert (covered == 1).all() and s.rank_shape[s.dim] * tp == shape[s.dim]


def _cases():
    for name, tp2, tp4 in TABLE:      # quantized formats only where a recipe could put them
        quantizable = role_of(name) not in (None, "vision")
        for fmt in ("bf16", "nvfp4", "q6_k") if quantizable else ("bf16",):
            yield pytest.param(name, tp2, tp4, fmt, id=f"{name}-{fmt}")


@pytest.mark.parametrize("name,tp2,tp4,fmt", list(_cases()))
def test_reference_table_shapes(name, tp2, tp4, fmt):
    shape = _shape(name)
    for tp, want in ((2, tp2), (4, tp4)):
        s = plan_split(name, shape, C27, tp, fmt)
        assert s.rank_shape == want
        if not s.replicated:
            _assert_tiles(s, shape, tp)


def test_every_27b_tensor_has_a_rule():
    """Every tensor of the 27B inventory is either replicated whole or tiled exactly once over TP4 ranks."""
    n_split = 0
    for name in expected_shapes(C27):
        dim, _ = rule_for(name)
        shape = _shape(name)
        s = plan_split(name, shape, C27, 4, "bf16")
        assert s.dim == dim, name
        if s.replicated:
            assert s.rank_shape == shape and s.ranges == ((),) * 4, name
        else:
            _assert_tiles(s, shape, 4)
            n_split += 1
    assert n_split > 0


def test_in_proj_qkv_three_ranges():
    s = plan_split("layers.0.linear_attn.in_proj_qkv.weight", (10240, 5120), C27, 2, "nvfp4")
    # q rows 0..2047 and k rows 2048..4095 by key head (8 per rank), v rows 4096.. by value head (24 per rank)
    assert s.ranges[1] == ((1024, 2048), (3072, 4096), (7168, 10240))


@pytest.mark.parametrize("tp", [2, 4])
def test_head_locality(tp):
    """Rank r's query heads use only its own KV heads; its value heads only its own key heads."""
    c = C27
    q = plan_split("layers.3.self_attn.q_proj.weight", (2 * c.q_width, 5120), c, tp, "bf16")
    kv = plan_split("layers.3.self_attn.k_proj.weight", (c.kv_width, 5120), c, tp, "bf16")
    z = plan_split("layers.0.linear_attn.in_proj_z.weight", (c.value_dim, 5120), c, tp, "bf16")
    qkv = plan_split("layers.0.linear_attn.in_proj_qkv.weight", (c.conv_dim, 5120), c, tp, "bf16")
    group, vgroup = c.num_attention_heads // c.num_key_value_heads, c.linear_num_value_heads // c.linear_num_key_heads
    for r in range(tp):
        (qa, qb), = q.ranges[r]
        heads = range(qa // (2 * c.head_dim), qb // (2 * c.head_dim))
        (ka, kb), = kv.ranges[r]
        assert {h // group for h in heads} == set(range(ka // c.head_dim, kb // c.head_dim))
        (za, zb), = z.ranges[r]
        vheads = range(za // c.linear_value_head_dim, zb // c.linear_value_head_dim)
        (kqa, kqb) = qkv.ranges[r][1]
        kheads = range((kqa - c.key_dim) // c.linear_key_head_dim, (kqb - c.key_dim) // c.linear_key_head_dim)
        assert {h // vgroup for h in vheads} == set(kheads)


def test_kv_heads_not_divisible():
    c = _cfg_27b(num_key_value_heads=2, num_attention_heads=24)
    with pytest.raises(SourceError, match=r"layers\.3\.self_attn\.k_proj\.weight: cannot split "
                                          r"num_key_value_heads=2 over --tp 4"):
        plan_split("layers.3.self_attn.k_proj.weight", (512, 5120), c, 4, "nvfp4")


@pytest.mark.parametrize("fmt,ok", [("nvfp4", True), ("q6_k", False), ("iq3_s", False), ("bf16", True)])
def test_column_cut_block_boundary(fmt, ok):
    # down_proj K = 1536 over TP4 -> 384-column shards: whole 16-blocks, not whole 256-blocks
    c = _cfg_27b(intermediate_size=1536)
    call = lambda: plan_split("layers.0.mlp.down_proj.weight", (5120, 1536), c, 4, fmt)  # noqa: E731
    if ok:
        assert call().rank_shape == (5120, 384)
    else:
        with pytest.raises(SourceError, match=r"layers\.0\.mlp\.down_proj\.weight: --tp cut at column 384 "
                                              r"of 1536 is not on a 256-column"):
            call()


def test_nvfp4_column_cut_off_16_block():
    c = _cfg_27b(num_attention_heads=8, num_key_value_heads=4, head_dim=24)   # o_proj K = 192 -> 48 per rank
    plan_split("layers.3.self_attn.o_proj.weight", (5120, 192), c, 4, "nvfp4")
    c = _cfg_27b(num_attention_heads=4, num_key_value_heads=4, head_dim=24)   # K = 96 -> 24 per rank
    with pytest.raises(SourceError, match="not on a 16-column nvfp4 block"):
        plan_split("layers.3.self_attn.o_proj.weight", (5120, 96), c, 4, "nvfp4")


def test_unknown_tensor_has_no_rule():
    with pytest.raises(SourceError, match="layers.0.mystery.weight: no tensor-parallel rule"):
        rule_for("layers.0.mystery.weight")


def test_recipe_roles_for_27b():
    r = load_recipe("nvfp4")
    fmts = {n: r.format_for(n, "bf16") for n in expected_shapes(C27)}
    assert fmts["layers.0.linear_attn.A_log"] == "bf16" and r.format_for("layers.0.linear_attn.A_log", "f32") == "f32"
    assert fmts["layers.0.linear_attn.in_proj_a.weight"] == "bf16"
    assert fmts["lm_head.weight"] == "q6_k" and fmts["embed_tokens.weight"] == "bf16"
    assert fmts["mtp.fc.weight"] == "q6_k" and fmts["mtp.layers.0.mlp.up_proj.weight"] == "q6_k"
    assert fmts["layers.3.self_attn.q_proj.weight"] == "nvfp4" and fmts["visual.blocks.0.attn.qkv.weight"] == "bf16"
    assert fmts["visual.patch_embed.proj.weight"] == "bf16"
