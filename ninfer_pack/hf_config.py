"""HF `config.json` (+ `generation_config.json`) of a Qwen3.8 checkpoint -> `ModelConfig`.

Accepts the VL layout (`model_type: qwen3_5` with `text_config`/`vision_config` and top-level token ids) and
the text-only layout saved from `Qwen3_5ForCausalLM` (`model_type: qwen3_5_text`, flat).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ninfer_formats.errors import NinferError, SourceError
from ninfer_formats.model_config import FULL, LINEAR, ModelConfig, VisionConfig
from ninfer_formats.model_schema import check_model

MODEL_TYPES = ("qwen3_5", "qwen3_5_text")
_TEXT_INTS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads",
              "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim")
_VISION_INTS = ("depth", "hidden_size", "intermediate_size", "num_heads", "patch_size", "temporal_patch_size",
                "spatial_merge_size", "out_hidden_size", "num_position_embeddings")


def split_sections(hf: dict, where: str) -> tuple[dict, dict, str]:
    """(text section, top level, model_type); refuses anything that is not a Qwen3.8 config."""
    mt = hf.get("model_type")
    if mt not in MODEL_TYPES:
        raise SourceError(f"{where}: model_type {mt!r} is not a Qwen3.8 model "
                          f"(expected {' or '.join(map(repr, MODEL_TYPES))})")
    if mt == "qwen3_5_text":
        return hf, hf, mt
    text = hf.get("text_config")
    if not isinstance(text, dict):
        raise SourceError(f"{where}: text_config is missing or not an object")
    if text.get("model_type", "qwen3_5_text") != "qwen3_5_text":
        raise SourceError(f"{where}: text_config.model_type {text.get('model_type')!r} is not 'qwen3_5_text'")
    return text, hf, mt


def _ids(v: Any) -> tuple[int, ...]:
    if v is None:
        return ()
    return tuple(v) if isinstance(v, (list, tuple)) else (v,)


def _positive_int(v: Any, field: str) -> int:
    # bool is an int to Python but never a count; a string "4" must not reach arithmetic
    if type(v) is not int or v <= 0:
        raise SourceError(f"{field}: expected a positive integer, got {v!r:.40}")
    return v


def _layer_types(text: dict, n: int, sect: str) -> list[str]:
    if "layer_types" in text:
        lt = text["layer_types"]
        # a bare string would be iterated per character; null would fail with a bare TypeError
        if not isinstance(lt, list) or not all(isinstance(t, str) for t in lt):
            raise SourceError(f"{sect}layer_types: expected an array of {LINEAR!r}/{FULL!r} names, got {lt!r:.40}")
        return lt
    # HF derives the schedule from this when layer_types is absent
    every = _positive_int(text.get("full_attention_interval", 4), sect + "full_attention_interval")
    return [FULL if (i + 1) % every == 0 else LINEAR for i in range(n)]


def _mtp_layers(text: dict, sect: str, mtp: bool) -> int:
    """1 when MTP is packed; the runtime (and the inventory) know exactly one MTP layer."""
    n = text.get("mtp_num_hidden_layers")
    if mtp and n is not None and (type(n) is not int or n not in (0, 1)):
        raise SourceError(f"{sect}mtp_num_hidden_layers: expected 0 or 1 (one MTP layer is supported), got "
                          f"{n!r:.40}; use --no-mtp to pack without MTP")
    return 1 if mtp else 0


def _number(v: Any, field: str) -> float:
    # float() would take "1e-6" strings and raise a bare ValueError on anything else
    if type(v) not in (int, float) or not math.isfinite(v):
        raise SourceError(f"{field}: expected a finite number, got {v!r:.40}")
    return float(v)


def _rope(text: dict, sect: str) -> dict[str, Any]:
    rp = text.get("rope_parameters") or {}
    if not isinstance(rp, dict):
        raise SourceError(f"{sect}rope_parameters: expected an object, got {type(rp).__name__}")
    where = f"{sect}rope_parameters."
    mrope = rp.get("mrope_section", (11, 11, 10))
    if not isinstance(mrope, (list, tuple)):
        raise SourceError(f"{where}mrope_section: expected an array of integers, got {mrope!r:.40}")
    return {"rope_theta": _number(rp.get("rope_theta", text.get("rope_theta", 10000.0)), where + "rope_theta"),
            "partial_rotary_factor": _number(rp.get("partial_rotary_factor",
                                                    text.get("partial_rotary_factor", 0.25)),
                                             where + "partial_rotary_factor"),
            "mrope_section": tuple(mrope)}


def _vision(hf: dict, where: str) -> VisionConfig:
    v = hf.get("vision_config")
    if not isinstance(v, dict):
        raise SourceError(f"{where}: vision_config is missing but the checkpoint holds model.visual.* tensors")
    missing = [k for k in _VISION_INTS if k not in v]
    if missing:
        raise SourceError(f"{where}: vision_config.{missing[0]} is missing")
    kw = {k: v[k] for k in _VISION_INTS}
    try:
        return VisionConfig(**kw, in_channels=v.get("in_channels", 3),
                            hidden_act=v.get("hidden_act", "gelu_pytorch_tanh"))
    except NinferError as e:
        msg = str(e)
        raise SourceError(f"{where}: {msg if msg.startswith('vision_config') else 'vision_config.' + msg}") from None


def to_model_config(hf: dict, gen: dict | None, *, mtp: bool, vision: bool,
                    where: str = "config.json") -> ModelConfig:
    """Build the artifact's ModelConfig; `mtp`/`vision` say whether those parts are packed."""
    text, top, mt = split_sections(hf, where)
    sect = "text_config." if text is not top else ""
    missing = [k for k in _TEXT_INTS if k not in text]
    if missing:
        raise SourceError(f"{where}: {sect}{missing[0]} is missing")
    gen = gen or {}
    _check_token_ids(text, top, sect, gen, where)
    eos = _ids(text.get("eos_token_id", top.get("eos_token_id")))
    eos += tuple(i for i in _ids(gen.get("eos_token_id")) if i not in eos)
    vis = _vision(hf, where) if vision else None
    try:
        cfg = ModelConfig(
            **{k: text[k] for k in _TEXT_INTS},
            layer_types=_layer_types(text, text["num_hidden_layers"], sect),
            rms_norm_eps=_number(text.get("rms_norm_eps", 1e-6), sect + "rms_norm_eps"), **_rope(text, sect),
            max_position_embeddings=_positive_int(text.get("max_position_embeddings", 32768),
                                                  sect + "max_position_embeddings"),
            tie_word_embeddings=top.get("tie_word_embeddings", text.get("tie_word_embeddings", False)),
            eos_token_ids=eos, bos_token_id=text.get("bos_token_id", top.get("bos_token_id")),
            pad_token_id=text.get("pad_token_id", top.get("pad_token_id")),
            mtp_num_hidden_layers=_mtp_layers(text, sect, mtp),
            image_token_id=top.get("image_token_id"), video_token_id=top.get("video_token_id"),
            vision_start_token_id=top.get("vision_start_token_id"),
            vision_end_token_id=top.get("vision_end_token_id"),
            vision=vis,
            extra={"source_model_type": mt})
    except SourceError as e:        # the helpers above name the field with its section already
        raise SourceError(f"{where}: {e}") from None
    except NinferError as e:        # ConfigError names the field; add the file
        raise SourceError(f"{where}: {sect}{e}") from None
    except TypeError as e:
        raise SourceError(f"{where}: {e}") from None
    try:
        # the artifact reader type-checks the stored `model` member; refuse here what it would refuse, so a bad
        # config.json fails before any packing and names config.json rather than the output file
        check_model(cfg.to_dict())
    except NinferError as e:
        raise SourceError(f"{where}: {e}") from None
    # types are settled now; a bad mrope_section would pack fine and only fail (confusingly) with images
    _check_mrope(cfg, text, sect, vision, where)
    return cfg


def _check_token_ids(text: dict, top: dict, sect: str, gen: dict, where: str) -> None:
    """eos/bos/pad must index the embedding: a stop id outside the vocab never fires, a bos id crashes.
    Checked per source field, so the message names the file that holds the bad value."""
    vocab = text["vocab_size"]
    vocab = vocab if type(vocab) is int and vocab > 0 else None     # a bad vocab_size is reported on its own
    gen_where = str(Path(where).with_name("generation_config.json"))
    for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
        field = sect + key if key in text else key
        sources = [(where, field, text.get(key, top.get(key)))]
        if key == "eos_token_id":            # only generation_config's eos ids reach the artifact
            sources.append((gen_where, key, gen.get(key)))
        for file, name, v in sources:
            for i in _ids(v):
                if type(i) is not int:
                    raise SourceError(f"{file}: {name}: expected a token id (integer), got {i!r:.40}")
                if vocab is not None and not 0 <= i < vocab:
                    raise SourceError(f"{file}: {name}: {i} is not a token id (vocab_size {vocab})")


def _check_mrope(cfg: ModelConfig, text: dict, sect: str, vision: bool, where: str) -> None:
    """Each rotary frequency takes its position from one of the (T, H, W) axes: 3 sections covering rot/2."""
    rp = text.get("rope_parameters") or {}
    if "mrope_section" not in rp and not vision:
        return                               # text only: positions are 1-D and the default is never read
    sec, half = cfg.mrope_section, cfg.rotary_dim // 2
    if len(sec) != 3 or min(sec) < 0 or sum(sec) != half:
        raise SourceError(f"{where}: {sect}rope_parameters.mrope_section: expected 3 non-negative integers "
                          f"summing to {half} (rotary dim {cfg.rotary_dim} / 2), got {list(sec)}")
