"""The complete tensor inventory a Qwen3.8 checkpoint must hold, as artifact names -> source shapes.

Derived from the config alone (qwen38-architecture.md §9, §14), so the packer can check every tensor of a
source before it starts, and name the first missing, extra or misshaped one.
Shapes are the HF (source) shapes; `artifact_shape` maps them to what the artifact stores.
"""
from __future__ import annotations

from ninfer_formats.model_config import ModelConfig, VisionConfig


def _full_attn(p: str, c: ModelConfig) -> dict[str, tuple[int, ...]]:
    h, d = c.hidden_size, c.head_dim
    return {
        f"{p}.self_attn.q_proj.weight": (2 * c.num_attention_heads * d, h),
        f"{p}.self_attn.k_proj.weight": (c.num_key_value_heads * d, h),
        f"{p}.self_attn.v_proj.weight": (c.num_key_value_heads * d, h),
        f"{p}.self_attn.o_proj.weight": (h, c.num_attention_heads * d),
        f"{p}.self_attn.q_norm.weight": (d,),
        f"{p}.self_attn.k_norm.weight": (d,),
    }


def _linear_attn(p: str, c: ModelConfig) -> dict[str, tuple[int, ...]]:
    h, nv = c.hidden_size, c.linear_num_value_heads
    return {
        f"{p}.linear_attn.in_proj_qkv.weight": (c.conv_dim, h),
        f"{p}.linear_attn.in_proj_z.weight": (c.value_dim, h),
        f"{p}.linear_attn.in_proj_a.weight": (nv, h),
        f"{p}.linear_attn.in_proj_b.weight": (nv, h),
        f"{p}.linear_attn.conv1d.weight": (c.conv_dim, 1, c.linear_conv_kernel_dim),
        f"{p}.linear_attn.A_log": (nv,),
        f"{p}.linear_attn.dt_bias": (nv,),
        f"{p}.linear_attn.norm.weight": (c.linear_value_head_dim,),
        f"{p}.linear_attn.out_proj.weight": (h, c.value_dim),
    }


def _layer(p: str, c: ModelConfig, full: bool) -> dict[str, tuple[int, ...]]:
    h, i = c.hidden_size, c.intermediate_size
    out = {f"{p}.input_layernorm.weight": (h,), f"{p}.post_attention_layernorm.weight": (h,),
           f"{p}.mlp.gate_proj.weight": (i, h), f"{p}.mlp.up_proj.weight": (i, h),
           f"{p}.mlp.down_proj.weight": (h, i)}
    out.update(_full_attn(p, c) if full else _linear_attn(p, c))
    return out


def text_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    out = {"embed_tokens.weight": (c.vocab_size, c.hidden_size), "norm.weight": (c.hidden_size,)}
    for i in range(c.num_hidden_layers):
        out.update(_layer(f"layers.{i}", c, c.is_full(i)))
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    return out


def mtp_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    h = c.hidden_size
    out = {"mtp.fc.weight": (h, 2 * h), "mtp.pre_fc_norm_embedding.weight": (h,),
           "mtp.pre_fc_norm_hidden.weight": (h,), "mtp.norm.weight": (h,)}
    out.update(_layer("mtp.layers.0", c, full=True))
    return out


def vision_shapes(v: VisionConfig) -> dict[str, tuple[int, ...]]:
    h, m = v.hidden_size, v.hidden_size * v.spatial_merge_size ** 2
    out = {"visual.patch_embed.proj.weight": (h, v.in_channels, v.temporal_patch_size,
                                              v.patch_size, v.patch_size),
           "visual.patch_embed.proj.bias": (h,),
           "visual.pos_embed.weight": (v.num_position_embeddings, h)}
    linears = {"attn.qkv": (3 * h, h), "attn.proj": (h, h),
               "mlp.linear_fc1": (v.intermediate_size, h), "mlp.linear_fc2": (h, v.intermediate_size)}
    for j in range(v.depth):
        p = f"visual.blocks.{j}"
        for norm in ("norm1", "norm2"):
            out[f"{p}.{norm}.weight"] = out[f"{p}.{norm}.bias"] = (h,)
        for mod, shape in linears.items():
            out[f"{p}.{mod}.weight"], out[f"{p}.{mod}.bias"] = shape, shape[:1]
    out["visual.merger.norm.weight"] = out["visual.merger.norm.bias"] = (h,)
    out["visual.merger.linear_fc1.weight"], out["visual.merger.linear_fc1.bias"] = (m, m), (m,)
    out["visual.merger.linear_fc2.weight"] = (v.out_hidden_size, m)
    out["visual.merger.linear_fc2.bias"] = (v.out_hidden_size,)
    return out


def expected_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the artifact of `c` holds (MTP and vision as the config enables them), source shapes."""
    out = text_shapes(c)
    if c.mtp_num_hidden_layers:
        out.update(mtp_shapes(c))
    if c.vision is not None:
        out.update(vision_shapes(c.vision))
    return out


def artifact_shape(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The stored (TP1) shape: depthwise conv1d [C, 1, ck] drops its singleton dim; the vision patch
    embedding Conv3d [hid, C, T, P, P] (kernel == stride, so a linear map of the flattened patch vector,
    which is how `pixel_values` arrive) is stored 2-D [hid, C*T*P*P] -- the container allows rank <= 4."""
    if name.endswith("linear_attn.conv1d.weight") and len(shape) == 3 and shape[1] == 1:
        return (shape[0], shape[2])
    if name == "visual.patch_embed.proj.weight" and len(shape) == 5:
        return (shape[0], shape[1] * shape[2] * shape[3] * shape[4])
    return tuple(shape)


def artifact_name(hf_name: str) -> str | None:
    """HF checkpoint name -> artifact name; None for names outside the model (reported as extra)."""
    for prefix, repl in (("model.language_model.", ""), ("model.visual.", "visual."), ("model.", "")):
        if hf_name.startswith(prefix):
            return repl + hf_name[len(prefix):]
    if hf_name.startswith(("lm_head.", "mtp.")):
        return hf_name
    return None
