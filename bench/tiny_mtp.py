"""MTP acceptance and held-out loss of the embedded ninfer-tiny model, measured with our runtime (CPU, fp32).

Data: the held-out files listed in `ninfer_pack/tiny/heldout.txt` (paths relative to the stdlib; the split
rule of tools/tiny_data.py is re-checked for each), read from THIS interpreter's stdlib and tokenized exactly
as training did (special-token text stays plain, <|endoftext|> after each file). Listed files missing here
are skipped and counted.

Per recipe (default bf16, then nvfp4) the model is packed (TP1) with `ninfer_pack.convert.convert`, then:
- held-out loss: windows of `--seq`+2 tokens of the held-out stream (training's layout), per-token NLL of
  the main model from our logits; the MTP loss and training's acceptance proxy
  P(argmax MTP[t] == argmax main[t+1]) from our MTP forward; compared with train_report.json;
- acceptance: `--prompts` windows of `--prompt-len` tokens inside held-out files, each followed by greedy
  generation of `--new-tokens` (eos ignored, so every prompt yields exactly that many), through the
  Engine with MTP K = 1..5 (all prompts batched). Ceiling, same run: K+1 tokens/round; plain greedy (K=0)
  is run first and every K is checked against it token for token (greedy speculation must be lossless).

    python bench/tiny_mtp.py [--recipes bf16,nvfp4] [--ks 1,2,3,4,5] [--threads 2]
    python bench/tiny_mtp.py --device cuda     # the Triton backend in bf16, CUDA graphs: the GPU path's acceptance
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "ninfer_pack" / "tiny"
RESULTS = ROOT / "bench" / "results" / "tiny_mtp.json"
sys.path.insert(0, str(ROOT / "tools"))
TIMING_NOTE = ("decode_tok_s / speedup_vs_plain_cpu: wall clock of the torch reference backend on a shared CPU; "
               "informative only (not a speed measurement of MTP), the acceptance numbers are exact counts")

TIMING_NOTE_GPU = ("decode_tok_s / speedup_vs_plain_cpu: wall clock of the Triton backend on the GPU; a model this "
                   "small is bound by the host's work per step, so informative only")

import tiny_data
import tiny_tokenizer
from ninfer_formats.atomic import write_json_atomic  # noqa: E402
from ninfer_rt import draft_head  # noqa: E402


def log(msg: str) -> None:
    print(f"[tiny_mtp {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---- data ----
def heldout_documents(folder: Path) -> tuple[list[np.ndarray], dict]:
    """Token ids of each listed held-out file (+ <|endoftext|>), and what was used / skipped."""
    listed = [ln.strip() for ln in (folder / "heldout.txt").read_text().splitlines() if ln.strip()]
    wrong = [r for r in listed if tiny_data.split_of(r) != "heldout"]
    if wrong:
        raise SystemExit(f"error: {folder}/heldout.txt lists {wrong[0]}, which the split rule puts in train")
    root, used, missing = tiny_data.stdlib_root(), [], []
    for rel in listed:
        text = tiny_data.read_source(root / rel) if (root / rel).is_file() else None
        (used if text and text.strip() else missing).append((rel, text))
    tok = tiny_tokenizer.load(folder)
    specials = tiny_tokenizer.special_ids(tok.get_vocab_size())
    docs = tiny_data.encode_documents(tok, [t for _, t in used], specials)
    info = {"stdlib": str(root), "python_version": sys.version.split()[0], "listed": len(listed),
            "used": len(used), "missing": [r for r, _ in missing], "tokens": int(sum(len(d) for d in docs))}
    return docs, info


def loss_windows(docs: list[np.ndarray], seq: int, cap: int | None) -> torch.Tensor:
    """[N, seq+2] consecutive windows of the concatenated stream (as train_tiny.heldout_windows)."""
    ids = np.concatenate(docs)
    n = (len(ids) - 2) // seq
    n = n if cap is None else min(n, cap)
    return torch.from_numpy(np.stack([ids[i * seq: i * seq + seq + 2] for i in range(n)]).astype(np.int64))


def prompt_windows(docs: list[np.ndarray], n: int, length: int) -> list[list[int]]:
    """n windows of `length` tokens lying inside one file each, evenly spaced over all valid starts."""
    starts = [(d, s) for d, doc in enumerate(docs) for s in range(len(doc) - 1 - length + 1)]
    if len(starts) < n:
        raise SystemExit(f"error: held-out files give only {len(starts)} windows of {length} tokens")
    pick = np.linspace(0, len(starts) - 1, n).round().astype(int)
    return [docs[starts[i][0]][starts[i][1]: starts[i][1] + length].tolist() for i in pick]


# ---- model ----
def pack(recipe: str, out: Path) -> Path:
    from ninfer_pack.convert import convert
    t = time.perf_counter()
    convert(str(TINY), out, recipe=recipe, tp=1, jobs=1, force=True, progress=False)
    log(f"packed {recipe} in {time.perf_counter() - t:.1f} s")
    return out


def load(art: Path, device: str = "cpu"):
    """CPU: the torch reference backend in fp32. CUDA: what serving runs, the Triton backend in bf16."""
    from ninfer_rt.backends import get_ops
    from ninfer_rt.loader import load as load_artifact
    if device == "cpu":
        return load_artifact(art, dtype=torch.float32), get_ops("torch")
    return load_artifact(art, device=torch.device(device), dtype=torch.bfloat16), get_ops("triton")


@torch.no_grad()
def heldout_metrics(loaded, ops, windows: torch.Tensor, batch: int) -> dict:
    """Main NLL, MTP NLL and the acceptance proxy over [N, T+2] windows (training's definitions)."""
    from ninfer_rt.model import Model, MtpInput, SeqInput
    from ninfer_rt.state import CacheConfig
    t = windows.shape[1] - 2
    pages = -(-t // 16) * batch
    model = Model(loaded.config, loaded.weights, ops, cache=CacheConfig(num_pages=pages, page_size=16, max_seqs=batch))
    ce = ce_mtp = accept = 0.0
    for i in range(0, len(windows), batch):
        w = windows[i:i + batch].to(loaded.device)
        states = [model.new_state() for _ in w]
        out = model.forward([SeqInput(row[:-2], st) for row, st in zip(w, states)])
        hid = [out.hidden[out.cu_seqlens[b]:out.cu_seqlens[b + 1]] for b in range(len(w))]
        mo = model.mtp_forward([MtpInput(row[1:-1], h, st.mtp) for row, h, st in zip(w, hid, states)])
        lg, mlg = out.logits.view(len(w), t, -1).float(), mo.logits.view(len(w), t, -1).float()
        ce += torch.nn.functional.cross_entropy(lg.flatten(0, 1), w[:, 1:-1].flatten(), reduction="sum").item()
        ce_mtp += torch.nn.functional.cross_entropy(mlg.flatten(0, 1), w[:, 2:].flatten(), reduction="sum").item()
        accept += (mlg.argmax(-1)[:, :-1] == lg.argmax(-1)[:, 1:]).sum().item()
        for st in states:
            st.free()
    n = windows[:, 1:-1].numel()
    # a draft-head shortlist gives the ids past it no probability: the MTP loss is then infinite, written as null
    return {"heldout_loss": ce / n, "mtp_heldout_loss": ce_mtp / n if math.isfinite(ce_mtp) else None,
            "mtp_accept_proxy": accept / (len(windows) * (t - 1)), "loss_tokens": n, "loss_windows": len(windows)}


def generate(loaded, ops, prompts: list[list[int]], k: int, new_tokens: int) -> tuple[dict, list[list[int]]]:
    """All prompts through one Engine (greedy); K=0 is plain decoding. -> (stats, outputs per prompt)."""
    from ninfer_rt.engine import Engine
    from ninfer_rt.sampling import SamplingParams
    from ninfer_rt.speculative import SpecConfig
    per_seq = -(-(max(map(len, prompts)) + new_tokens + k + 2) // 16)
    eng = Engine(loaded, ops, spec=SpecConfig(num_draft_tokens=k) if k else None, max_batch=len(prompts),
                 kv_pages=per_seq * len(prompts))
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    outs = {str(i): [] for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, params)
    t = time.perf_counter()
    while eng.has_work():
        for o in eng.step():
            outs[o.req_id] += o.new_token_ids
    wall = time.perf_counter() - t
    eng.shutdown()
    st = eng.stats.to_dict()
    st["wall_s"] = wall
    return st, [outs[str(i)] for i in range(len(prompts))]


def predicted_tpr(p: float, k: int) -> float:
    """Tokens/round if every draft position were accepted with the same conditional rate p."""
    return sum(p ** i for i in range(k + 1))


def conditional(cum: list[float]) -> list[float]:
    """P(d_i accepted | d_1..d_{i-1} accepted) from the cumulative P(d_i accepted)."""
    return [c / (cum[i - 1] if i else 1.0) if (cum[i - 1] if i else 1.0) > 0 else 0.0 for i, c in enumerate(cum)]


def run_recipe(recipe: str, work: Path, docs, prompts, args, train: dict) -> tuple[list[dict], list[dict]]:
    """Pack once, then per draft head (NINFER_DRAFT_HEAD, read when each model is built) the held-out metrics
    and the K sweep."""
    loaded, ops = load(pack(recipe, work / recipe), args.device)
    losses, records, before = [], [], os.environ.get(draft_head.ENV)
    try:
        for head in args.draft_heads:
            os.environ[draft_head.ENV] = head
            loss, recs = _run_head(recipe, head, loaded, ops, docs, prompts, args, train)
            losses.append(loss)
            records += recs
    finally:
        if before is None:
            os.environ.pop(draft_head.ENV, None)
        else:
            os.environ[draft_head.ENV] = before
        loaded.close()
    return losses, records


def _run_head(recipe, head, loaded, ops, docs, prompts, args, train) -> tuple[dict, list[dict]]:
    name = _label({"recipe": recipe, "draft_head": head})
    t = time.perf_counter()
    loss = heldout_metrics(loaded, ops, loss_windows(docs, args.seq, args.loss_windows), args.loss_batch)
    log(f"{name}: held-out loss {loss['heldout_loss']:.4f} (train report {train['heldout_loss']:.4f}), "
        f"mtp {_num(loss['mtp_heldout_loss'])}, proxy {loss['mtp_accept_proxy']:.3f} "
        f"in {time.perf_counter() - t:.0f} s")
    base, ref = generate(loaded, ops, prompts, 0, args.new_tokens)
    base_tok_s = base["decode_tokens"] / base["wall_s"]
    log(f"{name}: plain greedy {base_tok_s:.1f} tok/s")
    records = []
    for k in args.ks:
        st, outs = generate(loaded, ops, prompts, k, args.new_tokens)
        tok_s = st["decode_tokens"] / st["wall_s"]
        records.append({
            "recipe": recipe, "draft_head": head, "draft_tokens": k, "prompts": len(prompts),
            "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens, "tokens_per_round": st["tokens_per_round"],
            "acceptance_per_position": st["acceptance_per_position"],
            "acceptance_conditional": conditional(st["acceptance_per_position"]),
            "acceptance": st["acceptance"], "rounds": st["rounds"], "drafted": st["drafted"],
            "accepted": st["accepted"], "ceiling_tokens_per_round": k + 1,
            "ratio_to_ceiling": st["tokens_per_round"] / (k + 1),
            "predicted_tokens_per_round": predicted_tpr(train["mtp_accept_proxy"], k),
            "same_as_greedy": sum(a == b for a, b in zip(outs, ref)) / len(prompts),
            "heldout_loss": loss["heldout_loss"], "mtp_heldout_loss": loss["mtp_heldout_loss"],
            "mtp_accept_proxy": loss["mtp_accept_proxy"], "decode_tok_s": tok_s,
            "speedup_vs_plain_cpu": tok_s / base_tok_s})
        log(f"{name} K={k}: {st['tokens_per_round']:.3f} tokens/round, {tok_s:.1f} tok/s")
    return {"recipe": recipe, "draft_head": head, **loss, "plain_decode_tok_s": base_tok_s}, records


def _num(v) -> str:
    return "inf" if v is None else f"{v:.4f}"


def _label(r: dict) -> str:
    head = r.get("draft_head", "lm_head")
    return r["recipe"] if head == "lm_head" else f"{r['recipe']} [{head}]"


def print_table(records: list[dict], losses: list[dict], train: dict) -> None:
    print(f"{'recipe':<20} {'K':>2} {'tok/round':>9} {'ceil':>5} {'ratio':>6} {'pred':>5} "
          f"{'acc/pos (cumulative)':<32} {'lossless':>8}")
    for r in records:
        per = " ".join(f"{a:.2f}" for a in r["acceptance_per_position"])
        print(f"{_label(r):<20} {r['draft_tokens']:>2} {r['tokens_per_round']:>9.3f} "
              f"{r['ceiling_tokens_per_round']:>5} "
              f"{r['ratio_to_ceiling']:>6.3f} {r['predicted_tokens_per_round']:>5.2f} {per:<32} "
              f"{r['same_as_greedy']:>8.2f}")
    print(f"\n{'recipe':<20} {'heldout_loss':>12} {'mtp_loss':>9} {'proxy':>6} {'tokens':>7}")
    print(f"{'train':<20} {train['heldout_loss']:>12.4f} {train['mtp_heldout_loss']:>9.4f} "
          f"{train['mtp_accept_proxy']:>6.3f} {train['heldout_tokens']:>7}   (train_report.json, GPU bf16, Python "
          f"{train['python_version']})")
    for s in losses:
        print(f"{_label(s):<20} {s['heldout_loss']:>12.4f} {_num(s['mtp_heldout_loss']):>9} "
              f"{s['mtp_accept_proxy']:>6.3f} {s['loss_tokens']:>7}")


def write_results(path: Path, obj: dict) -> None:
    write_json_atomic(path, obj)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipes", default="bf16,nvfp4")
    ap.add_argument("--ks", default="1,2,3,4,5", help="draft counts K to measure")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--seq", type=int, default=512, help="held-out loss window (training used 512)")
    ap.add_argument("--loss-windows", type=int, default=None, help="cap on loss windows [default: all]")
    ap.add_argument("--loss-batch", type=int, default=8)
    ap.add_argument("--draft-heads", default="lm_head",
                    help="MTP draft heads to measure, comma-separated NINFER_DRAFT_HEAD values (ninfer_rt.draft_head)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--out", type=Path, default=RESULTS)
    a = ap.parse_args(argv)
    a.ks = [int(k) for k in a.ks.split(",")]
    a.draft_heads = a.draft_heads.split(",")
    for head in a.draft_heads:
        try:
            draft_head.DraftHeadSpec.parse(head)
        except Exception as e:                    # a one-line usage error, not a traceback
            ap.error(str(e))
    return a


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda: no CUDA device here")
    if args.device == "cuda" and "NINFER_GEMV_TUNE" not in os.environ:
        # the tokens are the point here, not the speed: a heuristic tile per GEMV key instead of timing every
        # candidate (each a compile; s37's two runs spent ~2 minutes per Engine before the first record)
        os.environ["NINFER_GEMV_TUNE"] = "0"
        log("NINFER_GEMV_TUNE=0 (set it to time the GEMV candidates)")
    torch.set_num_threads(args.threads)
    train = json.loads((TINY / "train_report.json").read_text())
    docs, data = heldout_documents(TINY)
    log(f"held-out: {data['used']}/{data['listed']} listed files on Python {data['python_version']} "
        f"({len(data['missing'])} missing), {data['tokens']} tokens (training saw {train['heldout_tokens_total']})")
    prompts = prompt_windows(docs, args.prompts, args.prompt_len)
    losses, records = [], []
    with tempfile.TemporaryDirectory(prefix="tiny-mtp-") as work:
        for recipe in args.recipes.split(","):
            loss, recs = run_recipe(recipe, Path(work), docs, prompts, args, train)
            losses += loss
            records += recs
    print_table(records, losses, train)
    keys = ("heldout_loss", "mtp_heldout_loss", "mtp_accept_proxy", "heldout_tokens", "heldout_tokens_total",
            "python_version", "checkpoint")
    write_results(args.out, {
        "bench": "tiny_mtp", "model": "ninfer-tiny", "device": args.device,
        "dtype": "float32" if args.device == "cpu" else "bfloat16", "threads": args.threads,
        "backend": "torch" if args.device == "cpu" else "triton",
        "draft_chain": os.environ.get("NINFER_DRAFT_CHAIN", "1") == "1",
        "gemv_tune": os.environ.get("NINFER_GEMV_TUNE") if args.device == "cuda" else None,
        "greedy": True, "ignore_eos": True, "heldout_data": data, "train_report": {k: train[k] for k in keys},
        "predicted_from": "train_report mtp_accept_proxy as every position's conditional acceptance",
        "timing_note": TIMING_NOTE if args.device == "cpu" else TIMING_NOTE_GPU,
        "heldout": losses, "records": records})
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
