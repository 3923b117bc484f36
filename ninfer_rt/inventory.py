"""The tensors a model config needs at a TP size, with per-rank shapes (reference §9, §13), and binding.

Column-parallel weights split their rows, row-parallel ones their columns, per contiguous head blocks;
embeddings and all norms are replicated; lm_head is vocab-parallel; `mtp.fc` may be replicated [H, 2H] or
split by input columns [H, 2H / tp] (then followed by an all-reduce). `visual.*` tensors belong to the vision
tower (checked there) and are accepted only when the config has one.
"""
from __future__ import annotations

from ninfer_formats.errors import LoadError
from ninfer_formats.model_config import ModelConfig


def _div(total: int, tp: int, field: str) -> int:
    if total % tp:
        raise LoadError(f"model.{field}: {total} is not divisible by the TP size {tp}")
    return total // tp


def _attn(p: str, c: ModelConfig, tp: int) -> dict:
    hq = _div(c.num_attention_heads, tp, "num_attention_heads")
    hk = _div(c.num_key_value_heads, tp, "num_key_value_heads")
    d, h = c.head_dim, c.hidden_size
    return {f"{p}self_attn.q_proj.weight": (2 * hq * d, h), f"{p}self_attn.k_proj.weight": (hk * d, h),
            f"{p}self_attn.v_proj.weight": (hk * d, h), f"{p}self_attn.o_proj.weight": (h, hq * d),
            f"{p}self_attn.q_norm.weight": (d,), f"{p}self_attn.k_norm.weight": (d,)}


def _gdn(p: str, c: ModelConfig, tp: int) -> dict:
    nk = _div(c.linear_num_key_heads, tp, "linear_num_key_heads")
    nv = _div(c.linear_num_value_heads, tp, "linear_num_value_heads")
    kd, vd, h = nk * c.linear_key_head_dim, nv * c.linear_value_head_dim, c.hidden_size
    a = f"{p}linear_attn."
    return {f"{a}in_proj_qkv.weight": (2 * kd + vd, h), f"{a}in_proj_z.weight": (vd, h),
            f"{a}in_proj_b.weight": (nv, h), f"{a}in_proj_a.weight": (nv, h),
            f"{a}conv1d.weight": (2 * kd + vd, c.linear_conv_kernel_dim), f"{a}A_log": (nv,),
            f"{a}dt_bias": (nv,), f"{a}norm.weight": (c.linear_value_head_dim,), f"{a}out_proj.weight": (h, vd)}


def _block(p: str, c: ModelConfig, tp: int, full: bool) -> dict:
    i, h = _div(c.intermediate_size, tp, "intermediate_size"), c.hidden_size
    out = {f"{p}input_layernorm.weight": (h,), f"{p}post_attention_layernorm.weight": (h,),
           f"{p}mlp.gate_proj.weight": (i, h), f"{p}mlp.up_proj.weight": (i, h), f"{p}mlp.down_proj.weight": (h, i)}
    out.update(_attn(p, c, tp) if full else _gdn(p, c, tp))
    return out


def expected(c: ModelConfig, tp: int) -> dict[str, tuple[int, ...]]:
    """name -> per-rank shape of every text/MTP tensor (mtp.fc listed with its replicated shape)."""
    h = c.hidden_size
    out = {"embed_tokens.weight": (c.vocab_size, h), "norm.weight": (h,)}
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = (_div(c.vocab_size, tp, "vocab_size"), h)
    for i in range(c.num_hidden_layers):
        out.update(_block(f"layers.{i}.", c, tp, c.is_full(i)))
    if c.mtp_num_hidden_layers:
        out.update({"mtp.fc.weight": (h, 2 * h), "mtp.pre_fc_norm_embedding.weight": (h,),
                    "mtp.pre_fc_norm_hidden.weight": (h,), "mtp.norm.weight": (h,)})
        out.update(_block("mtp.layers.0.", c, tp, True))
    return out


def bind(shapes: dict[str, tuple[int, ...]], c: ModelConfig, tp: int, where: str = "") -> None:
    """Raise LoadError naming the first missing, unexpected or misshaped tensor."""
    want = expected(c, tp)
    at = f" in {where}" if where else ""
    for name in sorted(want):
        if name not in shapes:
            raise LoadError(f"tensor {name}: missing{at}")
    for name in sorted(shapes):
        if name.startswith("visual."):
            if c.vision is None:
                raise LoadError(f"tensor {name}: unexpected{at} (the config has no vision tower)")
            continue
        if name not in want:
            raise LoadError(f"tensor {name}: unexpected{at}")
        got, exp = tuple(shapes[name]), want[name]
        if name == "mtp.fc.weight" and tp > 1 and got == (exp[0], _div(exp[1], tp, "hidden_size")):
            continue
        if got != exp:
            raise LoadError(f"tensor {name}: shape {list(got)}{at}, expected {list(exp)} at TP{tp}")
