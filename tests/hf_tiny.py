"""Tiny random Qwen3.8 (HF `qwen3_5`) checkpoints and references for tests.

Stable API (other tests import it):
  build_hf_model(*, seed=0, vocab=256, hidden=64, layers=4, mtp=True, vision=False,
                 dtype=torch.float32, **overrides) -> TinyHF
  make_tiny_checkpoint(dir, *, same keywords) -> dir      # a real HF folder
  load_hf_reference(dir) -> TinyHF                         # rebuild the HF modules from such a folder
  mtp_oracle(text_config, *, seed=0, dtype=torch.float32) -> MtpOracle
  model_config_from_hf(text_config, *, mtp=True, vision_config=None) -> ninfer ModelConfig
  artifact_weights(tiny) -> {artifact name: tensor}        # TP1 names/shapes as in DESIGN.md

The folder: `config.json` (flat `qwen3_5_text` when vision=False, composite `qwen3_5` when vision=True),
`generation_config.json`, safetensors shards of ~100 KB + `model.safetensors.index.json` in the VL layout
(`model.language_model.*`, `model.visual.*`, `lm_head.weight`, then the 15 `mtp.*` tensors), `A_log` always F32,
and a byte-level tokenizer (`tokenizer.json`, `tokenizer_config.json`, `chat_template.jinja`) whose token id =
byte value; the specials take the ids of bytes that never occur in UTF-8 (0xF6..0xFF), so vocab 256 suffices.

The MTP oracle is vLLM's MTP semantics rebuilt from HF modules (reference §11/§16): fc over
[norm_emb(embed(next token)) ; norm_hidden(target hidden)] -> one full-attention Qwen3_5DecoderLayer (no cache:
causal mask over the whole sequence) -> mtp.norm. It is not an upstream oracle.
"""
from __future__ import annotations

import copy
import json
import sys
from dataclasses import dataclass
from pathlib import Path

# fla / causal_conv1d importable would route transformers' CPU path to Triton kernels (reference §17.2)
for _m in ("fla", "causal_conv1d"):
    sys.modules.setdefault(_m, None)

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from torch import nn  # noqa: E402
from transformers import (Qwen3_5Config, Qwen3_5ForCausalLM,  # noqa: E402
                          Qwen3_5ForConditionalGeneration, Qwen3_5TextConfig)
from transformers.models.qwen3_5.modeling_qwen3_5 import (Qwen3_5DecoderLayer,  # noqa: E402
                                                          Qwen3_5RMSNorm, Qwen3_5TextRotaryEmbedding)

from hf_tiny_tok import (CHAT_TEMPLATE, EOS_ID, IM_END_ID, SPECIALS, tokenizer_json,  # noqa: E402,F401
                            write_tiny_tokenizer)

TEXT_PREFIX = "model.language_model."
SHARD_BYTES = 100_000



def tiny_text_config(*, vocab=256, hidden=64, layers=4, mtp=True, **overrides) -> Qwen3_5TextConfig:
    """The reference §16 geometry (GQA 4/2, GDN nk 2 / nv 4) with every 4th layer full attention."""
    kw = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
              num_attention_heads=4, num_key_value_heads=2, head_dim=32,
              linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
              linear_value_head_dim=16, linear_conv_kernel_dim=4, max_position_embeddings=512,
              tie_word_embeddings=False, rms_norm_eps=1e-6,
              rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                               "mrope_section": [2, 1, 1], "mrope_interleaved": True},
              bos_token_id=EOS_ID, eos_token_id=EOS_ID, pad_token_id=None)
    kw.update(overrides)
    if mtp:
        kw.setdefault("mtp_num_hidden_layers", 1)
        kw.setdefault("mtp_use_dedicated_embeddings", False)
    return Qwen3_5TextConfig(**kw)


def _vision_config(hidden: int) -> dict:
    return dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4, spatial_merge_size=2,
                temporal_patch_size=2, in_channels=3, out_hidden_size=hidden, num_position_embeddings=16)


class MtpOracle(nn.Module):
    """MTP draft module from HF building blocks; state-dict names match real checkpoints' `mtp.*`."""

    def __init__(self, text_config: Qwen3_5TextConfig):
        super().__init__()
        c = copy.deepcopy(text_config)
        c.layer_types, c.num_hidden_layers = ["full_attention"], 1
        c._attn_implementation = "eager"
        h, eps = c.hidden_size, c.rms_norm_eps
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = Qwen3_5RMSNorm(h, eps=eps)
        self.pre_fc_norm_hidden = Qwen3_5RMSNorm(h, eps=eps)
        self.layers = nn.ModuleList([Qwen3_5DecoderLayer(c, 0)])
        self.norm = Qwen3_5RMSNorm(h, eps=eps)
        self.rotary_emb = Qwen3_5TextRotaryEmbedding(c)

    @torch.no_grad()
    def forward(self, embed: nn.Embedding, token_ids: torch.Tensor, hidden: torch.Tensor,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """token_ids [T] (the NEXT tokens), hidden [T, H] (target post-norm hiddens) -> [T, H] after mtp.norm.

        The whole sequence is processed at once with a causal mask: equal to incremental decoding with a KV cache.
        """
        t = token_ids.shape[0]
        e = self.pre_fc_norm_embedding(embed(token_ids))
        u = self.fc(torch.cat([e, self.pre_fc_norm_hidden(hidden)], dim=-1))[None]
        pos = torch.arange(t) if positions is None else positions
        cos_sin = self.rotary_emb(u, pos.view(1, 1, -1).expand(3, 1, -1))
        mask = torch.full((t, t), torch.finfo(u.dtype).min, dtype=u.dtype).triu(1)[None, None]
        u = self.layers[0](u, position_embeddings=cos_sin, attention_mask=mask)
        return self.norm(u)[0]


def _randomize(module: nn.Module) -> None:
    """(1+w) norms init to 0 = identity in HF; randomize them (and dt_bias) so the gains are exercised."""
    with torch.no_grad():
        for n, p in module.named_parameters():
            if "linear_attn.norm" in n:
                p.normal_(1.0, 0.1)
            elif "norm" in n:
                p.normal_(0.0, 0.1)
            elif n.endswith("dt_bias"):
                p.normal_(1.0, 0.1)


def mtp_oracle(text_config: Qwen3_5TextConfig, *, seed: int = 0, dtype=torch.float32) -> MtpOracle:
    with torch.random.fork_rng():
        torch.manual_seed(seed + 1)
        m = MtpOracle(text_config)
        with torch.no_grad():
            for n, p in m.named_parameters():
                if "norm" not in n:
                    p.normal_(0.0, text_config.initializer_range)
        _randomize(m)
    _cast_keep_alog(m, dtype)
    return m.eval()


@dataclass
class TinyHF:
    """HF reference modules of one tiny checkpoint."""

    model: nn.Module                  # Qwen3_5ForCausalLM, or Qwen3_5ForConditionalGeneration (vision)
    text_config: Qwen3_5TextConfig
    mtp: MtpOracle | None
    vision_config: dict | None

    def causal_lm(self) -> Qwen3_5ForCausalLM:
        """Text-only HF model (shares weights with `model` when it is already one)."""
        if isinstance(self.model, Qwen3_5ForCausalLM):
            return self.model
        lm = Qwen3_5ForCausalLM(self.text_config).to(self.model.lm_head.weight.dtype).eval()
        sd = {"model." + k[len(TEXT_PREFIX):]: v for k, v in self.model.state_dict().items()
              if k.startswith(TEXT_PREFIX)}
        sd["lm_head.weight"] = self.model.lm_head.weight
        lm.load_state_dict(sd, strict=True, assign=True)
        return lm

    @property
    def embed(self) -> nn.Embedding:
        return self.model.get_input_embeddings()

    @property
    def lm_head(self) -> nn.Linear:
        return self.model.lm_head

    def checkpoint_state_dict(self) -> dict[str, torch.Tensor]:
        """Tensors under their real-checkpoint names (VL layout), mtp.* last."""
        sd = {}
        for k, v in self.model.state_dict().items():
            if isinstance(self.model, Qwen3_5ForCausalLM) and k.startswith("model."):
                k = TEXT_PREFIX + k[len("model."):]
            sd[k] = v
        if self.mtp is not None:
            sd.update({"mtp." + k: v for k, v in self.mtp.state_dict().items()})
        return {k: v.detach().contiguous() for k, v in sd.items()}


def build_hf_model(*, seed=0, vocab=256, hidden=64, layers=4, mtp=True, vision=False,
                   dtype=torch.float32, **overrides) -> TinyHF:
    """Random tiny model (HF init, randomized norms); A_log stays fp32 whatever `dtype` (as in real files)."""
    tcfg = tiny_text_config(vocab=vocab, hidden=hidden, layers=layers, mtp=mtp, **overrides)
    vcfg = _vision_config(hidden) if vision else None
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        if vision:
            cfg = Qwen3_5Config(text_config=dict(model_type="qwen3_5_text", **_text_kwargs(tcfg)),
                                vision_config=vcfg, image_token_id=SPECIALS["<|image_pad|>"],
                                video_token_id=SPECIALS["<|video_pad|>"],
                                vision_start_token_id=SPECIALS["<|vision_start|>"],
                                vision_end_token_id=SPECIALS["<|vision_end|>"], tie_word_embeddings=False)
            model = Qwen3_5ForConditionalGeneration(cfg)
            tcfg = model.config.text_config
        else:
            model = Qwen3_5ForCausalLM(tcfg)
        _randomize(model)
    model = model.eval()
    _cast_keep_alog(model, dtype)
    oracle = mtp_oracle(tcfg, seed=seed, dtype=dtype) if mtp else None
    return TinyHF(model=model, text_config=tcfg, mtp=oracle, vision_config=vcfg)


def _text_kwargs(tcfg: Qwen3_5TextConfig) -> dict:
    d = tcfg.to_dict()
    for k in ("transformers_version", "architectures", "model_type", "_name_or_path", "dtype",
              "id2label", "label2id", "output_hidden_states", "return_dict", "output_attentions"):
        d.pop(k, None)
    return d


def _cast_keep_alog(model: nn.Module, dtype) -> None:
    """Cast parameters only: rotary inv_freq buffers stay fp32 (as when loading), A_log stays fp32."""
    for n, p in model.named_parameters():
        if not n.endswith("A_log"):
            p.data = p.data.to(dtype)


def make_tiny_checkpoint(dir, *, seed=0, vocab=256, hidden=64, layers=4, mtp=True, vision=False,
                         dtype=torch.float32, **overrides):
    """Write a tiny random checkpoint as a real HF folder (see module doc); returns `dir`."""
    tiny = build_hf_model(seed=seed, vocab=vocab, hidden=hidden, layers=layers, mtp=mtp, vision=vision,
                          dtype=dtype, **overrides)
    d = Path(dir)
    d.mkdir(parents=True, exist_ok=True)
    _write_shards(d, tiny.checkpoint_state_dict())
    _write_config(d, tiny, dtype)
    write_tiny_tokenizer(d)
    return dir


def _write_shards(d: Path, sd: dict[str, torch.Tensor]) -> None:
    shards, cur, size = [], {}, 0
    for k, v in sd.items():
        nbytes = v.numel() * v.element_size()
        if cur and size + nbytes > SHARD_BYTES:
            shards.append(cur)
            cur, size = {}, 0
        cur[k], size = v, size + nbytes
    shards.append(cur)
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: v.contiguous() for k, v in shard.items()}, str(d / name), metadata={"format": "pt"})
        for k, v in shard.items():
            weight_map[k] = name
            total += v.numel() * v.element_size()
    index = {"metadata": {"total_parameters": sum(v.numel() for v in sd.values()), "total_size": total},
             "weight_map": weight_map}
    (d / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _write_config(d: Path, tiny: TinyHF, dtype) -> None:
    cfg = tiny.model.config.to_dict()
    cfg["dtype"] = str(dtype).removeprefix("torch.")
    if not isinstance(tiny.model, Qwen3_5ForCausalLM):
        cfg["text_config"]["dtype"] = cfg["dtype"]
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    gen = {"bos_token_id": EOS_ID, "eos_token_id": [IM_END_ID, EOS_ID], "pad_token_id": EOS_ID,
           "do_sample": True, "temperature": 1.0, "top_p": 0.95, "top_k": 20}
    (d / "generation_config.json").write_text(json.dumps(gen, indent=2))


# ---- reading a folder back ----------------------------------------------------------------------------

def read_checkpoint(dir) -> dict[str, torch.Tensor]:
    d = Path(dir)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    out = {}
    for shard in sorted(set(index["weight_map"].values())):
        out.update(load_file(str(d / shard)))
    return out


def load_hf_reference(dir) -> TinyHF:
    """Rebuild the HF modules (+ MTP oracle) of a folder written by make_tiny_checkpoint."""
    d = Path(dir)
    cfg_d = json.loads((d / "config.json").read_text())
    sd = read_checkpoint(d)
    kw = {k: v for k, v in cfg_d.items() if k not in ("model_type", "transformers_version")}
    if cfg_d.get("model_type") == "qwen3_5":
        model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(**kw))
        tcfg, vcfg = model.config.text_config, cfg_d["vision_config"]
        msd = {k: v for k, v in sd.items() if not k.startswith("mtp.")}
    else:
        tcfg = Qwen3_5TextConfig(**kw)
        model, vcfg = Qwen3_5ForCausalLM(tcfg), None
        msd = {("model." + k[len(TEXT_PREFIX):] if k.startswith(TEXT_PREFIX) else k): v
               for k, v in sd.items() if not k.startswith("mtp.")}
    model.load_state_dict(msd, strict=True, assign=True)
    oracle = None
    mtp_sd = {k[4:]: v for k, v in sd.items() if k.startswith("mtp.")}
    if mtp_sd:
        oracle = MtpOracle(tcfg)
        oracle.load_state_dict(mtp_sd, strict=True, assign=True)
        oracle.eval()
    return TinyHF(model=model.eval(), text_config=tcfg, mtp=oracle, vision_config=vcfg)


# ---- bridges to ninfer (for runtime tests that do not go through the packer) ---------------------------

def model_config_from_hf(tcfg: Qwen3_5TextConfig, *, mtp: bool = True, vision_config: dict | None = None):
    from ninfer_formats.model_config import ModelConfig, VisionConfig
    rp = tcfg.rope_parameters
    eos = tcfg.eos_token_id
    vision = None
    if vision_config is not None:
        vision = VisionConfig(**{k: vision_config[k] for k in (
            "depth", "hidden_size", "intermediate_size", "num_heads", "patch_size", "temporal_patch_size",
            "spatial_merge_size", "in_channels", "out_hidden_size", "num_position_embeddings")})
    return ModelConfig(
        vocab_size=tcfg.vocab_size, hidden_size=tcfg.hidden_size, intermediate_size=tcfg.intermediate_size,
        num_hidden_layers=tcfg.num_hidden_layers, num_attention_heads=tcfg.num_attention_heads,
        num_key_value_heads=tcfg.num_key_value_heads, head_dim=tcfg.head_dim,
        linear_num_key_heads=tcfg.linear_num_key_heads, linear_num_value_heads=tcfg.linear_num_value_heads,
        linear_key_head_dim=tcfg.linear_key_head_dim, linear_value_head_dim=tcfg.linear_value_head_dim,
        linear_conv_kernel_dim=tcfg.linear_conv_kernel_dim, layer_types=tuple(tcfg.layer_types),
        rms_norm_eps=tcfg.rms_norm_eps, rope_theta=float(rp["rope_theta"]),
        partial_rotary_factor=float(rp.get("partial_rotary_factor", 1.0)),
        mrope_section=tuple(rp.get("mrope_section", (11, 11, 10))),
        max_position_embeddings=tcfg.max_position_embeddings, tie_word_embeddings=tcfg.tie_word_embeddings,
        eos_token_ids=tuple(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else []),
        bos_token_id=tcfg.bos_token_id, pad_token_id=tcfg.pad_token_id,
        mtp_num_hidden_layers=1 if mtp else 0, vision=vision,
        **({} if vision is None else dict(
            image_token_id=SPECIALS["<|image_pad|>"], video_token_id=SPECIALS["<|video_pad|>"],
            vision_start_token_id=SPECIALS["<|vision_start|>"], vision_end_token_id=SPECIALS["<|vision_end|>"])))


def artifact_weights(tiny: TinyHF) -> dict[str, torch.Tensor]:
    """TP1 artifact tensors (DESIGN.md names): prefixes dropped, conv1d [C, ck], visual.* kept with the
    Conv3d patch embedding flattened to [hid, C*T*P*P] (as the packer stores it)."""
    out = {}
    for k, v in tiny.checkpoint_state_dict().items():
        if k.startswith(TEXT_PREFIX):
            k = k[len(TEXT_PREFIX):]
        elif k.startswith("model.visual."):
            k = k[len("model."):]
        if k.endswith("conv1d.weight"):
            v = v[:, 0, :]
        if k == "visual.patch_embed.proj.weight":
            v = v.reshape(v.shape[0], -1)
        out[k] = v.contiguous()
    return out


def loaded_model(tiny: TinyHF, path: str = "tiny"):
    """What the engine takes from the loader (config, TP1 weights, path) for a tiny HF model, without a file."""
    import types
    return types.SimpleNamespace(config=model_config_from_hf(tiny.text_config), weights=artifact_weights(tiny),
                                 path=path)


# ---- tiny .ninfer artifacts (written directly with the container, cut with the packer's TP table) -------

_NVFP4_GROUPS = ((r"self_attn\.[qkv]_proj", "qkv"), (r"mlp\.(gate|up)_proj", "gate_up"),
                 (r"linear_attn\.in_proj_(qkv|z)", "qkvz"))
_F8_ROWS = r"(self_attn\.o_proj|linear_attn\.out_proj|mlp\.down_proj)\.weight|mtp\.fc\.weight"


def _artifact_fmt(name: str, w: torch.Tensor, quant: bool) -> tuple[str, str | None]:
    """(format, nvfp4 fusion-group key or None). quant=True: nvfp4 fusion groups, f8 rows for outputs."""
    import re
    if quant:
        for pat, tag in _NVFP4_GROUPS:
            m = re.fullmatch(rf"(.*){pat}\.weight", name)
            if m:
                return "nvfp4", m.group(1) + tag
        if re.fullmatch(rf"(.*\.)?({_F8_ROWS})", name):
            return "f8_e4m3_row", None
    return ("f32" if w.dtype == torch.float32 else "bf16"), None


def artifact_tensors(tiny: TinyHF, *, tp: int = 1, quant: bool = False) -> list[dict]:
    """Per rank {name: (fmt, shape, container bytes)} of the tiny model (packer TP table, shared nvfp4 scales)."""
    from ninfer_formats import codecs
    from ninfer_pack.tp_split import plan_split
    cfg = model_config_from_hf(tiny.text_config, mtp=tiny.mtp is not None, vision_config=tiny.vision_config)
    weights = artifact_weights(tiny)
    fmts = {n: _artifact_fmt(n, w, quant) for n, w in weights.items()}
    groups: dict[str, list] = {}
    for n, (fmt, key) in fmts.items():
        if key:
            groups.setdefault(key, []).append(weights[n].float().numpy())
    gscale = {k: codecs.nvfp4.global_scale(*ws) for k, ws in groups.items()}
    ranks: list[dict] = [{} for _ in range(tp)]
    for n, w in weights.items():
        fmt, key = fmts[n]
        sp = plan_split(n, tuple(w.shape), cfg, tp, fmt)
        for r in range(tp):
            part = w if sp.replicated else torch.cat([w.narrow(sp.dim, a, b - a) for a, b in sp.ranges[r]], sp.dim)
            data = codecs.encode(fmt, part.float().numpy(), global_scale=gscale.get(key), name=n)
            ranks[r][n] = (fmt, tuple(part.shape), data)
    return ranks


def tiny_resources() -> dict[str, bytes]:
    gen = {"bos_token_id": EOS_ID, "eos_token_id": [IM_END_ID, EOS_ID], "do_sample": True, "temperature": 1.0,
           "top_p": 0.95, "top_k": 20}
    tcfg = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    return {"tokenizer.json": tokenizer_json().encode(), "tokenizer_config.json": json.dumps(tcfg).encode(),
            "chat_template.jinja": CHAT_TEMPLATE.encode(), "generation_config.json": json.dumps(gen).encode()}


def make_tiny_artifact(dir, tiny: TinyHF | None = None, *, tp: int = 1, quant: bool = False, stem: str = "model",
                       ranks: list[dict] | None = None, resources: dict | None = None, **build_kw) -> list[str]:
    """Write a tiny TP set `{stem}.tp{tp}-rank{r}.ninfer` into `dir`; returns the paths. `ranks` overrides
    the tensors (tests that need a broken inventory), `resources` the tokenizer files (broken templates)."""
    from ninfer_formats.container import write_artifact
    tiny = tiny or build_hf_model(**build_kw)
    cfg = model_config_from_hf(tiny.text_config, mtp=tiny.mtp is not None, vision_config=tiny.vision_config)
    ranks = ranks if ranks is not None else artifact_tensors(tiny, tp=tp, quant=quant)
    meta = {"source": "hf_tiny", "recipe": {"default": "nvfp4+f8" if quant else "plain"}}
    return write_artifact(dir, stem, cfg, ranks, resources if resources is not None else tiny_resources(), meta)
