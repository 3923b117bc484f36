"""The model config carried in every artifact: enough to build the model without the HF config."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from .errors import NinferError

LINEAR, FULL = "linear_attention", "full_attention"


class ConfigError(NinferError):
    """A config field is missing, of the wrong type, or inconsistent (message names the field)."""


@dataclass(frozen=True)
class VisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    in_channels: int
    out_hidden_size: int
    num_position_embeddings: int
    hidden_act: str = "gelu_pytorch_tanh"

    def __post_init__(self):
        _positive(self, [f.name for f in fields(self) if f.type in ("int", int)])
        if self.hidden_size % self.num_heads:
            raise ConfigError("vision_config.hidden_size: not a multiple of num_heads")


@dataclass(frozen=True)
class ModelConfig:
    """Qwen3.8 (HF `qwen3_5_text`) text decoder + optional MTP and vision tower."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    layer_types: tuple[str, ...]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e7
    partial_rotary_factor: float = 0.25
    mrope_section: tuple[int, ...] = (11, 11, 10)
    max_position_embeddings: int = 262144
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    mtp_num_hidden_layers: int = 0
    image_token_id: int | None = None
    video_token_id: int | None = None
    vision_start_token_id: int | None = None
    vision_end_token_id: int | None = None
    vision: VisionConfig | None = None
    extra: dict = field(default_factory=dict)   # informative only (e.g. source model_type)

    def __post_init__(self):
        _positive(self, ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                         "num_attention_heads", "num_key_value_heads", "head_dim",
                         "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                         "linear_value_head_dim", "linear_conv_kernel_dim"])
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        object.__setattr__(self, "mrope_section", tuple(self.mrope_section))
        object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(f"layer_types: {len(self.layer_types)} entries for "
                              f"num_hidden_layers={self.num_hidden_layers}")
        bad = sorted(set(self.layer_types) - {LINEAR, FULL})
        if bad:
            raise ConfigError(f"layer_types: unknown layer type {bad[0]!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("num_attention_heads: not a multiple of num_key_value_heads")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ConfigError("linear_num_value_heads: not a multiple of linear_num_key_heads")
        if self.rotary_dim % 2 or self.rotary_dim <= 0 or self.rotary_dim > self.head_dim:
            raise ConfigError(f"partial_rotary_factor: rotary dim {self.rotary_dim} is invalid")
        if self.mtp_num_hidden_layers not in (0, 1):
            raise ConfigError("mtp_num_hidden_layers: only 0 or 1 MTP layer is supported")

    # ---- derived sizes (never stored) ----
    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def q_width(self) -> int:           # query part only; q_proj has 2x this (per-head [q|gate])
        return self.num_attention_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def key_dim(self) -> int:           # GDN Kd
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:         # GDN Vd
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    def is_full(self, i: int) -> bool:
        return self.layer_types[i] == FULL

    # ---- (de)serialisation: the artifact directory's "model" member ----
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for k, v in d.items():
            if isinstance(v, tuple):
                d[k] = list(v)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        """Strict: unknown or missing (non-default) members are errors."""
        if not isinstance(d, dict):
            raise ConfigError("model: not an object")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ConfigError(f"model.{unknown[0]}: unknown member")
        d = dict(d)
        if d.get("vision") is not None:
            v = d["vision"]
            vn = {f.name for f in fields(VisionConfig)}
            if not isinstance(v, dict) or set(v) - vn:
                raise ConfigError("model.vision: unknown or malformed member")
            try:
                d["vision"] = VisionConfig(**v)
            except TypeError as e:
                raise ConfigError(f"model.vision: {e}") from None
        try:
            return cls(**d)
        except TypeError as e:
            raise ConfigError(f"model: {e}") from None


def _positive(obj, names):
    for n in names:
        v = getattr(obj, n)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ConfigError(f"{n}: expected a positive integer, got {v!r}")
