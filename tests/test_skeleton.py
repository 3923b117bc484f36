import pytest

from ninfer_formats.constants import FORMATS, NVFP4_BLOCK, QK_K
from ninfer_formats.model_config import ConfigError, ModelConfig


def _cfg(**kw):
    base = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
                linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                linear_conv_kernel_dim=4, layer_types=["linear_attention"] * 3 + ["full_attention"])
    base.update(kw)
    return ModelConfig(**base)


def test_encoded_sizes():
    assert FORMATS["q6_k"].encoded_size((3, 2 * QK_K)) == 3 * 2 * 210
    assert FORMATS["iq3_s"].encoded_size((5, QK_K)) == 5 * 110
    assert FORMATS["nvfp4"].encoded_size((7, 4 * NVFP4_BLOCK)) == 16 + 7 * 32 + 7 * 4
    assert FORMATS["bf16"].encoded_size((3, 5)) == 30


def test_config_roundtrip_and_errors():
    c = _cfg()
    assert ModelConfig.from_dict(c.to_dict()) == c
    assert c.rotary_dim == 8 and c.conv_dim == 2 * 32 + 64
    with pytest.raises(ConfigError, match="layer_types"):
        _cfg(layer_types=["linear_attention"])
    with pytest.raises(ConfigError, match="model.bogus"):
        ModelConfig.from_dict({**c.to_dict(), "bogus": 1})
