"""Train ninfer-tiny: a small Qwen3.8-architecture model (HF `qwen3_5_text`) + one MTP layer, on the stdlib.

Joint loss = CE(next token) + mtp_weight * CE(token t+2 from the MTP layer). The MTP layer follows vLLM's
qwen3_5_mtp semantics rebuilt from HF modules: at position t it reads the main model's final-normed hidden
h_t and the embedding of token t+1, `u = fc([norm_emb(embed(x_{t+1})) ; norm_hidden(h_t)])` (embedding
FIRST), one full-attention decoder layer at the unshifted positions, `mtp.norm`, shared `lm_head`.

    python3 tools/train_tiny.py --out DIR --minutes 7 --device cuda          # the shipped model
    (on the device machine: `NINFER_WITH_FLA=0 source bench/device_env.sh` first: transformers trains
    through fla when it imports, and fla's backward refuses Triton < 3.7.1 on Hopper)
    python3 tools/train_tiny.py --out DIR --minutes 0.2 --device cpu --batch 2 --seq 128 --max-files 40

The export (tools/tiny_export.py) is an HF folder (config.json, model*.safetensors [+ index when sharded],
generation_config.json, heldout.txt, train_report.json); --with-tokenizer also copies tokenizer.json,
tokenizer_config.json and chat_template.jinja from --tokenizer-dir (left out by default: they are committed
in ninfer_pack/tiny/ and the GPU transport returns at most 8 files).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny_data  # noqa: E402
import tiny_export  # noqa: E402
import tiny_tokenizer  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
PRESETS = {   # TP2: every row-parallel shard K (o_proj 256, out_proj 256, down_proj 256, mtp.fc 256) is a
              # multiple of 256 and every column-parallel row count a multiple of 128 (except in_proj_a/b)
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=8,
                 num_key_value_heads=4, head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8,
                 linear_key_head_dim=64, linear_value_head_dim=64, mrope_section=[3, 3, 2]),
    "test": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                 linear_key_head_dim=16, linear_value_head_dim=16, mrope_section=[2, 1, 1]),
}


class TrainError(ValueError):
    """Bad arguments or an unusable output folder (message names the option/path)."""


@dataclass(frozen=True)
class Options:
    out: str
    minutes: float = 7.0
    device: str = "cuda"
    preset: str = "tiny"
    steps: int | None = None           # cap on optimizer steps (the LR schedule follows the tighter cap)
    epochs: float = 12.0               # cap in passes over the train stream (~10M params, ~10M tokens)
    batch: int = 128
    seq: int = 512
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.1
    mtp_weight: float = 0.5
    seed: int = 1234
    max_files: int | None = None
    eval_every_s: float = 30.0
    eval_windows: int | None = None     # cap on held-out windows in the final evaluation
    tokenizer_dir: str = str(REPO / "ninfer_pack" / "tiny")
    with_tokenizer: bool = False
    force: bool = False

    def __post_init__(self):
        if self.preset not in PRESETS:
            raise TrainError(f"--preset: unknown preset {self.preset!r} (have {sorted(PRESETS)})")
        if self.device not in ("cpu", "cuda"):
            raise TrainError(f"--device: expected cpu or cuda, got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise TrainError("--device cuda: torch sees no CUDA device")
        for name in ("batch", "seq", "warmup"):
            if getattr(self, name) < 1:
                raise TrainError(f"--{name}: must be >= 1")
        if self.minutes <= 0 or self.epochs <= 0 or (self.steps is not None and self.steps < 1):
            raise TrainError("--minutes/--epochs/--steps: must be positive")
        if not 0 <= self.mtp_weight <= 10 or not 0 < self.lr < 1:
            raise TrainError("--mtp-weight/--lr: out of range")


def make_config(preset: str, vocab_size: int):
    from transformers import Qwen3_5TextConfig
    p = dict(PRESETS[preset])
    ids = tiny_tokenizer.special_ids(vocab_size)
    n = p["num_hidden_layers"]
    cfg = Qwen3_5TextConfig(
        vocab_size=vocab_size, **{k: v for k, v in p.items() if k != "mrope_section"},
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)],
        linear_conv_kernel_dim=4, hidden_act="silu", rms_norm_eps=1e-6, max_position_embeddings=8192,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                         "mrope_section": p["mrope_section"], "mrope_interleaved": True},
        tie_word_embeddings=False, attention_bias=False, initializer_range=0.02, use_cache=True,
        bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|endoftext|>"], pad_token_id=None,
        attn_implementation="sdpa",
        # read by vLLM-style loaders / kept as plain attributes by HF (as in the real checkpoints)
        mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False, attn_output_gate=True,
        output_gate_type="swish", mamba_ssm_dtype="float32")
    return cfg


class MTP(nn.Module):
    """The Qwen3.5/3.8 MTP draft layer (15 tensors under `mtp.`); embedding and lm_head are the main model's."""

    def __init__(self, cfg):
        super().__init__()
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm
        lcfg = type(cfg).from_dict({**cfg.to_dict(), "num_hidden_layers": 1, "layer_types": ["full_attention"]})
        lcfg._attn_implementation = "sdpa"   # mask=None -> causal SDPA; eager would attend everywhere
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = Qwen3_5RMSNorm(h, eps=eps)
        self.pre_fc_norm_hidden = Qwen3_5RMSNorm(h, eps=eps)
        self.layers = nn.ModuleList([Qwen3_5DecoderLayer(lcfg, 0)])
        self.norm = Qwen3_5RMSNorm(h, eps=eps)
        for name, prm in self.named_parameters():   # HF's init: N(0, 0.02) matrices, (1+w) norms at 0
            with torch.no_grad():
                prm.normal_(0.0, cfg.initializer_range) if prm.ndim == 2 else prm.zero_()

    def forward(self, next_emb, hidden, position_embeddings):
        u = self.fc(torch.cat([self.pre_fc_norm_embedding(next_emb), self.pre_fc_norm_hidden(hidden)], dim=-1))
        u = self.layers[0](u, position_embeddings=position_embeddings, attention_mask=None)
        return self.norm(u)


def forward_losses(model, mtp, ids):
    """ids [B, T+2] -> (main CE, MTP CE, main logits [B,T,V], MTP logits [B,T,V])."""
    x, y1, y2 = ids[:, :-2], ids[:, 1:-1], ids[:, 2:]
    hidden = model.model(input_ids=x, use_cache=False).last_hidden_state      # after model.norm
    logits = model.lm_head(hidden)
    b, t = x.shape
    pos = torch.arange(t, device=x.device).view(1, 1, t).expand(3, b, t)   # text: 3 equal MRoPE rows
    pe = model.model.rotary_emb(hidden, pos)
    mtp_logits = model.lm_head(mtp(model.model.embed_tokens(y1), hidden, pe))
    ce = F.cross_entropy(logits.flatten(0, 1).float(), y1.flatten())
    ce_mtp = F.cross_entropy(mtp_logits.flatten(0, 1).float(), y2.flatten())
    return ce, ce_mtp, logits, mtp_logits


def autocast(opts):
    """bf16 autocast on the GPU; plain fp32 on the CPU (smoke runs and tests)."""
    if opts.device == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


@torch.no_grad()
def evaluate(model, mtp, windows: torch.Tensor, opts) -> dict:
    """Held-out metrics over [N, T+2] windows; mtp_accept_proxy = P(argmax MTP[t] == argmax main[t+1])."""
    model.eval(), mtp.eval()
    sums = dict(ce=0.0, ce_mtp=0.0, top1=0.0, mtp_top1=0.0, accept=0.0)
    n_tok = n_acc = 0
    for i in range(0, len(windows), opts.batch):
        w = windows[i:i + opts.batch].to(opts.device, non_blocking=True)
        with autocast(opts):
            ce, ce_mtp, lg, mlg = forward_losses(model, mtp, w)
        k = w[:, 1:-1].numel()
        am, amm = lg.argmax(-1), mlg.argmax(-1)
        sums["ce"] += ce.item() * k
        sums["ce_mtp"] += ce_mtp.item() * k
        sums["top1"] += (am == w[:, 1:-1]).sum().item()
        sums["mtp_top1"] += (amm == w[:, 2:]).sum().item()
        sums["accept"] += (amm[:, :-1] == am[:, 1:]).sum().item()
        n_tok += k
        n_acc += amm[:, :-1].numel()
    model.train(), mtp.train()
    return {"loss": sums["ce"] / n_tok, "mtp_loss": sums["ce_mtp"] / n_tok, "top1": sums["top1"] / n_tok,
            "mtp_top1": sums["mtp_top1"] / n_tok, "mtp_accept_proxy": sums["accept"] / n_acc, "tokens": n_tok}


def heldout_windows(ids: np.ndarray, seq: int, cap: int | None) -> torch.Tensor:
    n = (len(ids) - 2) // seq
    if n < 1:
        raise TrainError(f"held-out stream has {len(ids)} tokens, need at least {seq + 2} (raise --max-files)")
    w = np.stack([ids[i * seq: i * seq + seq + 2] for i in range(n if cap is None else min(n, cap))])
    return torch.from_numpy(w.astype(np.int64))


def lr_at(opts, step: int, progress: float) -> float:
    warm = min(1.0, (step + 1) / opts.warmup)
    cos = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return opts.lr * warm * (opts.min_lr_ratio + (1 - opts.min_lr_ratio) * cos)


def make_optimizer(model, mtp, opts):
    params = [p for m in (model, mtp) for p in m.parameters()]
    decay = [p for p in params if p.ndim >= 2]
    other = [p for p in params if p.ndim < 2]     # norms, A_log, dt_bias
    kw = {"fused": True} if opts.device == "cuda" else {}
    return torch.optim.AdamW([{"params": decay, "weight_decay": opts.weight_decay},
                              {"params": other, "weight_decay": 0.0}], lr=opts.lr, betas=(0.9, 0.95), **kw)


def snapshot(model, mtp):
    return ({k: v.detach().clone() for k, v in model.state_dict().items()},
            {k: v.detach().clone() for k, v in mtp.state_dict().items()})


def train_step(model, mtp, opt, batch, opts) -> tuple[float, float] | None:
    """One update; None (and no update) when the loss or the gradient is not finite."""
    with autocast(opts):
        ce, ce_mtp, _, _ = forward_losses(model, mtp, batch)
        loss = ce + opts.mtp_weight * ce_mtp
    opt.zero_grad(set_to_none=True)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], 1.0)
    if not bool(torch.isfinite(norm)):
        opt.zero_grad(set_to_none=True)
        return None
    opt.step()
    return ce.item(), ce_mtp.item()


def train_loop(model, mtp, train_ids: torch.Tensor, val: torch.Tensor, opts, deadline: float,
               total_steps: int) -> dict:
    """Random windows of the train stream; cosine over max(step/total_steps, time/budget); keeps the best
    held-out snapshot. An out-of-memory first step halves the batch (the H200 run cannot be retried cheaply)."""
    opt = make_optimizer(model, mtp, opts)
    gen = torch.Generator().manual_seed(opts.seed)
    span = torch.arange(opts.seq + 2, device=opts.device)
    t_start, step, seen, ema, bsz, bad = time.time(), 0, 0, None, opts.batch, 0
    best, last_eval, last_log = (math.inf, None, -1), t_start, t_start
    budget = max(deadline - t_start, 1e-3)
    while True:
        progress = max(step / total_steps, (time.time() - t_start) / budget)
        if progress >= 1.0:
            break
        for g in opt.param_groups:
            g["lr"] = lr_at(opts, step, progress)
        starts = torch.randint(0, len(train_ids) - opts.seq - 2, (bsz,), generator=gen)
        batch = train_ids[starts.to(opts.device)[:, None] + span]
        try:
            cur = train_step(model, mtp, opt, batch, opts)
        except torch.cuda.OutOfMemoryError:
            if step > 0 or bsz == 1:
                raise
            bsz, total_steps = bsz // 2, total_steps * 2
            log(f"out of memory on the first step; batch -> {bsz}")
            opt.zero_grad(set_to_none=True), torch.cuda.empty_cache()
            continue
        step, seen = step + 1, seen + bsz * opts.seq
        if cur is None:
            bad += 1
            if bad > 20:
                raise TrainError(f"step {step}: loss/gradient not finite in {bad} steps (lower --lr)")
            continue
        ema = cur if ema is None else tuple(0.98 * e + 0.02 * c for e, c in zip(ema, cur))
        now = time.time()
        if now - last_log > 15 or step == 1:
            last_log = now
            log(f"step {step}/{total_steps} loss {ema[0]:.4f} mtp {ema[1]:.4f} lr {opt.param_groups[0]['lr']:.2e} "
                f"{seen / (now - t_start):.0f} tok/s")
        if now - last_eval > opts.eval_every_s:
            last_eval, m = now, evaluate(model, mtp, val, opts)
            log(f"eval step {step}: heldout {m['loss']:.4f} mtp {m['mtp_loss']:.4f}")
            if m["loss"] < best[0]:
                best = (m["loss"], snapshot(model, mtp), step)
    ema = ema or (math.nan, math.nan)
    return {"steps": step, "skipped_steps": bad, "batch_used": bsz, "tokens": seen, "train_loss": ema[0],
            "train_mtp_loss": ema[1], "train_seconds": time.time() - t_start, "best": best}


def log(msg: str) -> None:
    print(f"[train_tiny {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def prepare_data(opts):
    tok = tiny_tokenizer.load(opts.tokenizer_dir)
    specials = tiny_tokenizer.special_ids(tok.get_vocab_size())
    corpus = tiny_data.collect(max_files=opts.max_files)
    train_ids, held_ids, n_chats = tiny_data.token_streams(tok, corpus, specials, seed=opts.seed)
    if len(train_ids) < opts.seq + 3:
        raise TrainError(f"train stream has {len(train_ids)} tokens, need more than {opts.seq + 2}")
    info = {"python_version": corpus.python_version, "corpus_hash": corpus.corpus_hash,
            "file_list_hash": corpus.file_list_hash, "split_rule": tiny_data.SPLIT_RULE,
            "train_files": len(corpus.train), "heldout_files": len(corpus.heldout),
            "skipped_files": len(corpus.skipped), "chat_examples": n_chats,
            "train_tokens_unique": int(len(train_ids)), "heldout_tokens_total": int(len(held_ids)),
            "tokenizer_sha256": _sha256(Path(opts.tokenizer_dir) / "tokenizer.json")}
    return tok, corpus, train_ids, held_ids, info


def build(opts, vocab_size: int):
    from transformers import Qwen3_5ForCausalLM
    torch.manual_seed(opts.seed)
    cfg = make_config(opts.preset, vocab_size)
    model = Qwen3_5ForCausalLM(cfg).to(opts.device).train()
    mtp = MTP(cfg).to(opts.device).train()
    return cfg, model, mtp


def _sha256(path: Path) -> str:
    import hashlib
    return hashlib.sha256(path.read_bytes()).hexdigest()


def select_checkpoint(model, mtp, val, best, opts) -> str:
    """Keep the final weights unless an earlier snapshot scored better on the selection windows."""
    best_loss, best_state, best_step = best
    if best_state is None or evaluate(model, mtp, val, opts)["loss"] <= best_loss:
        return "final"
    model.load_state_dict(best_state[0]), mtp.load_state_dict(best_state[1])
    return f"best@{best_step}"


def make_report(opts, cfg, model, mtp, stats, chosen, m, info) -> dict:
    return {"seed": opts.seed, "options": asdict(opts), "config": PRESETS[opts.preset] | {"vocab_size": cfg.vocab_size},
            "params": {"main": sum(p.numel() for p in model.parameters()),
                       "mtp": sum(p.numel() for p in mtp.parameters())},
            **stats, "tokens_per_second": stats["tokens"] / max(stats["train_seconds"], 1e-9),
            "checkpoint": chosen, "selection_note": "checkpoint chosen on the first 256 held-out windows",
            "heldout_loss": m["loss"], "heldout_ppl": math.exp(m["loss"]), "mtp_heldout_loss": m["mtp_loss"],
            "heldout_top1": m["top1"], "mtp_heldout_top1": m["mtp_top1"],
            "mtp_accept_proxy": m["mtp_accept_proxy"], "heldout_tokens": m["tokens"], **info,
            "torch_version": torch.__version__, "transformers_version": _tf_version(),
            "device_name": torch.cuda.get_device_name() if opts.device == "cuda" else "cpu"}


def run(opts: Options) -> dict:
    t0 = time.time()
    out = Path(opts.out)
    if out.exists() and any(out.iterdir()) and not opts.force:
        raise TrainError(f"{out}: output folder exists and is not empty (use --force to replace it)")
    if opts.device == "cuda":
        torch.set_float32_matmul_precision("high")   # the fp32 GDN chunk math may use TF32
    tok, corpus, train_ids, held_ids, info = prepare_data(opts)
    log(f"data: {info['train_tokens_unique']} train / {info['heldout_tokens_total']} held-out tokens, "
        f"{info['train_files']} files, python {info['python_version']} ({time.time() - t0:.1f}s)")
    cfg, model, mtp = build(opts, tok.get_vocab_size())
    val_all = heldout_windows(held_ids, opts.seq, opts.eval_windows)
    val = val_all[:256]
    total = math.ceil(opts.epochs * len(train_ids) / (opts.batch * opts.seq))
    total = min(total, opts.steps) if opts.steps else total
    with torch.enable_grad():   # callers (e.g. a test process that served a model) may have turned grad off
        stats = train_loop(model, mtp, torch.from_numpy(train_ids.astype(np.int64)).to(opts.device), val,
                           opts, deadline=t0 + 60 * opts.minutes, total_steps=max(total, 1))
    chosen = select_checkpoint(model, mtp, val, stats.pop("best"), opts)
    m = evaluate(model, mtp, val_all, opts)
    report = make_report(opts, cfg, model, mtp, stats, chosen, m, info)
    model.cpu(), mtp.cpu()
    report["seconds"] = time.time() - t0
    tiny_export.export(out, cfg, model, mtp, report, [rel for rel, _ in corpus.heldout], val_all[:1],
                       tokenizer_dir=opts.tokenizer_dir if opts.with_tokenizer else None)
    log(f"heldout loss {m['loss']:.4f} (ppl {math.exp(m['loss']):.2f}) mtp {m['mtp_loss']:.4f} "
        f"accept~{m['mtp_accept_proxy']:.3f} ({chosen}); wrote {out} in {time.time() - t0:.1f}s")
    return report


def _tf_version() -> str:
    import transformers
    return transformers.__version__


def parse_args(argv=None) -> tuple[Options, bool]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    d = argparse.Namespace(**{f.name: f.default for f in fields(Options)})
    ap.add_argument("--out", required=True, help="export folder (replaced atomically)")
    ap.add_argument("--minutes", type=float, default=d.minutes, help="wall-clock budget to the end of training")
    ap.add_argument("--device", default=d.device, choices=["cpu", "cuda"])
    ap.add_argument("--preset", default=d.preset, choices=sorted(PRESETS))
    for name in ("steps", "batch", "seq", "warmup", "seed", "max_files", "eval_windows"):
        ap.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    for name in ("epochs", "lr", "min_lr_ratio", "weight_decay", "mtp_weight", "eval_every_s"):
        ap.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(d, name))
    ap.add_argument("--tokenizer-dir", default=d.tokenizer_dir)
    ap.add_argument("--with-tokenizer", action="store_true", help="copy the tokenizer files into --out")
    ap.add_argument("--force", action="store_true", help="replace a non-empty --out")
    ap.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
    a = vars(ap.parse_args(argv))
    as_json = a.pop("json")
    return Options(**a), as_json


def main(argv=None) -> int:
    try:
        opts, as_json = parse_args(argv)
        report = run(opts)
    except (TrainError, tiny_data.DataError, tiny_tokenizer.TokenizerError, tiny_export.ExportError,
            OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    keys = ("steps", "tokens", "train_loss", "heldout_loss", "heldout_ppl", "mtp_heldout_loss",
            "mtp_accept_proxy", "seconds")
    print(json.dumps(report) if as_json else "\n".join(f"{k}: {report[k]}" for k in keys))
    return 0


if __name__ == "__main__":
    sys.exit(main())
