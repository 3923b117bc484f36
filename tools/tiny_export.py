"""Export of ninfer-tiny as a real HF checkpoint folder (text-only names `model.*`, `lm_head.weight`, `mtp.*`).

Weights are bf16 except `A_log` (F32, as in the real checkpoints). Over SHARD_BYTES the weights are split into
balanced shards + model.safetensors.index.json so that no file exceeds the 16 MiB device-transport limit.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny_tokenizer  # noqa: E402

SHARD_BYTES = int(15.5 * 2**20)
MTP_TENSORS = 15


class ExportError(ValueError):
    """The export cannot be written or does not have the real checkpoint layout."""


def export_tensors(model, mtp) -> dict[str, torch.Tensor]:
    """HF text names; bf16 except A_log (F32, as in the real checkpoints)."""
    sd = dict(model.state_dict())
    sd.update({f"mtp.{k}": v for k, v in mtp.state_dict().items()})
    return {k: (v.float() if k.endswith(".A_log") else v.to(torch.bfloat16)).detach().cpu().contiguous()
            for k, v in sorted(sd.items())}


def write_weights(tensors: dict, folder: Path) -> list[str]:
    """One model.safetensors, or balanced shards + model.safetensors.index.json when over SHARD_BYTES."""
    from safetensors.torch import save_file
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    n = max(1, math.ceil(total / SHARD_BYTES))
    shards, acc = [[] for _ in range(n)], 0
    for name, t in tensors.items():   # mtp.* sorts last, as in the real checkpoints
        shards[min(n - 1, acc * n // total)].append(name)
        acc += t.numel() * t.element_size()
    if n == 1:
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return ["model.safetensors"]
    files, weight_map = [], {}
    for i, names in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        save_file({k: tensors[k] for k in names}, str(folder / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in names})
        files.append(fname)
    index = {"metadata": {"total_parameters": sum(t.numel() for t in tensors.values()), "total_size": total},
             "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return files + ["model.safetensors.index.json"]


_CONFIG_NOISE = frozenset({"_name_or_path", "id2label", "label2id", "chunk_size_feed_forward", "is_encoder_decoder",
                           "problem_type", "return_dict", "output_attentions", "output_hidden_states"})


def write_configs(cfg, folder: Path) -> list[str]:
    ids = tiny_tokenizer.special_ids(cfg.vocab_size)
    d = {k: v for k, v in cfg.to_dict().items() if k not in _CONFIG_NOISE}
    d.update(architectures=["Qwen3_5ForCausalLM"], dtype="bfloat16")
    (folder / "config.json").write_text(json.dumps(d, indent=2, sort_keys=True) + "\n")
    gen = {"bos_token_id": ids["<|endoftext|>"], "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
           "pad_token_id": ids["<|endoftext|>"], "do_sample": True, "temperature": 0.7, "top_p": 0.8,
           "top_k": 20}
    (folder / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return ["config.json", "generation_config.json"]


def reload_check(folder: Path, window: torch.Tensor) -> dict:
    """transformers must load the export; its main loss on one held-out window is recorded."""
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        lg = m(input_ids=window[:, :-2]).logits
        ce = F.cross_entropy(lg.flatten(0, 1), window[:, 1:-1].flatten()).item()
    return {"class": type(m).__name__, "heldout_loss_first_window_fp32": ce}


def export(out, cfg, model, mtp, report: dict, heldout: list[str], window, tokenizer_dir=None) -> list[str]:
    """Write the folder to OUT.partial, check that transformers loads it, then rename it to OUT.
    `report` gains `reload` and `files` and is written as train_report.json."""
    out = Path(out)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tensors = export_tensors(model, mtp)
    if sum(k.startswith("mtp.") for k in tensors) != MTP_TENSORS:
        raise ExportError(f"{out}: MTP module has {sum(k.startswith('mtp.') for k in tensors)} tensors, expected 15")
    files = write_weights(tensors, tmp) + write_configs(cfg, tmp)
    if tokenizer_dir is not None:
        for name in tiny_tokenizer.FILES:
            shutil.copyfile(Path(tokenizer_dir) / name, tmp / name)
            files.append(name)
    (tmp / "heldout.txt").write_text("".join(f"{rel}\n" for rel in heldout))
    report["reload"] = reload_check(tmp, window)
    report["files"] = sorted(files + ["heldout.txt", "train_report.json"])
    (tmp / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")
    for p in tmp.iterdir():
        p.chmod(0o644)                # safetensors writes 0600
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return report["files"]
