"""Packer benchmark at full Qwen3.8-27B widths: peak RSS and per-core throughput per recipe.

A synthetic checkpoint with the real widths (vocab 248320, hidden 5120, MLP 17408, 24/4 heads of 256, GDN
16/48 heads of 128) and `--layers` layers (default 2: one GDN + one full attention) of random bf16 (A_log
F32) is written with safetensors directly, one tensor per shard, and cached in --workdir. Each recipe is
converted by `ninfer-pack convert` in a subprocess; we record wall time, the peak RSS of the largest process
(getrusage of the waited child, which includes its own waited workers), the sampled peak RSS summed over
the whole process tree and its anonymous part (the container hashes rank files through mmap, so file-backed
pages up to one rank file's size show in the parent's RSS), and derive M weights/s/core.

Ceiling, measured in the same run: single-core codec throughput (encode + the decode the packer does for
its error report) on a 4M-weight chunk per format, plus a copy ceiling for pass-through tensors; the ideal
per-core time of a recipe is the sum over its tensors of numel / ceiling(format); with a sequential
write + fsync probe of the work folder, ideal wall = max(ideal core time / jobs, output bytes / write
bandwidth). Ratio = ideal wall / measured wall. `busy` = weights per second of worker time (report.json
seconds), i.e. without idle cores: with 2 layers, lm_head (1.27 G weights, one task) is a long serial
tail; a 64-layer model hides it behind its layers.

Default IQ3_S run: the numpy IQ3_S encoder runs at ~1 M weights/s/core, so by default only attn_out and
gdn_out (o_proj, out_proj: 63 M weights over 2 layers) are IQ3_S and everything else is overridden to bf16
(`--iq3s-full` runs the whole recipe: roughly 12 core-minutes per 2 layers).

    python bench/pack.py [-j 2] [--layers 2] [--recipes nvfp4,q6_k,iq3_s,bf16] [--workdir /tmp/ninfer-bench]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "pack.json"
WIDTHS = dict(vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_attention_heads=24,
              num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=48,
              linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4)
IQ3S_LIGHT = ("embedding=bf16", "lm_head=bf16", "attn_in=bf16", "gdn_in=bf16", "mlp_in=bf16", "mlp_out=bf16",
              "mtp=bf16")


def hf_config(layers: int) -> dict:
    types = ["linear_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    return {"model_type": "qwen3_5_text", "architectures": ["Qwen3_5ForCausalLM"], **WIDTHS,
            "num_hidden_layers": layers, "layer_types": types, "rms_norm_eps": 1e-6, "max_position_embeddings": 262144,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                "mrope_section": [11, 11, 10], "mrope_interleaved": True},
            "tie_word_embeddings": False, "eos_token_id": 248044, "bos_token_id": 248044}


def make_checkpoint(d: Path, layers: int) -> Path:
    """Random bf16 tensors (HF-init scale), one shard each; reused when the marker matches."""
    import torch
    from safetensors.torch import save_file

    from ninfer_formats.model_config import ModelConfig
    from ninfer_pack.hf_config import to_model_config
    from ninfer_pack.inventory import text_shapes
    cfg_d = hf_config(layers)
    marker = d / "bench-marker.json"
    if marker.exists() and json.loads(marker.read_text()) == cfg_d:
        return d
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    cfg: ModelConfig = to_model_config(cfg_d, None, mtp=False, vision=False)
    g, weight_map = torch.Generator().manual_seed(0), {}
    for i, (name, shape) in enumerate(text_shapes(cfg).items()):
        hf = "lm_head.weight" if name == "lm_head.weight" else "model.language_model." + name
        dtype = torch.float32 if name.endswith("A_log") else torch.bfloat16
        t = torch.empty(shape, dtype=dtype).normal_(0.0, 0.02, generator=g)
        f = f"model-{i:05d}.safetensors"
        save_file({hf: t}, str(d / f), metadata={"format": "pt"})
        weight_map[hf] = f
        del t
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (d / "config.json").write_text(json.dumps(cfg_d, indent=1))
    marker.write_text(json.dumps(cfg_d))
    return d


def _tree_rss(root: int) -> tuple[int, int]:
    """(RSS, anonymous RSS) in bytes summed over `root` and all its descendants, from /proc.

    Anonymous RSS is the packer's own memory; the rest is file-backed (e.g. the container mapping a rank
    file to hash it), which the kernel can drop under pressure."""
    kids: dict[int, list[int]] = {}
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                ppid = int(open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[1])
                kids.setdefault(ppid, []).append(int(p))
            except (OSError, IndexError, ValueError):
                continue
    rss = anon = 0
    todo = [root]
    while todo:
        pid = todo.pop()
        try:
            fields = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status").read().splitlines()
                          if ":" in line)
            rss += int(fields.get("VmRSS", "0 kB").split()[0]) * 1024
            anon += int(fields.get("RssAnon", "0 kB").split()[0]) * 1024
        except (OSError, ValueError):
            pass
        todo += kids.get(pid, [])
    return rss, anon


def run_convert(src: Path, out: Path, recipe: str, jobs: int, overrides=()) -> dict:
    cmd = [sys.executable, "-c", "import sys; from ninfer_pack.cli import main; sys.exit(main())", "convert",
           str(src), str(out), "--recipe", recipe, "-j", str(jobs), "--quiet", "--force", "--json",
           *[a for o in overrides for a in ("--override", o)]]
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak, stop = [0, 0], threading.Event()

    def sample():
        while not stop.is_set():
            peak[:] = map(max, peak, _tree_rss(p.pid))
            stop.wait(0.2)
    th = threading.Thread(target=sample, daemon=True)
    th.start()
    stdout, stderr = p.stdout.read(), p.stderr.read()     # a waited child: its rusage includes its workers
    _, status, ru = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    stop.set()
    th.join()
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode:
        raise SystemExit(f"convert {recipe} failed ({p.returncode}): {stderr.strip()[-2000:]}")
    report = json.loads((out / "report.json").read_text())
    return {"wall_s": wall, "max_process_rss": ru.ru_maxrss * 1024, "tree_rss_peak": peak[0],
            "tree_anon_rss_peak": peak[1],
            "summary": json.loads(stdout), "report": report}


def codec_ceiling() -> dict[str, float]:
    """Single-core weights/s per format: encode + decode of a 4M-weight chunk (what a worker does)."""
    from ninfer_formats import codecs
    w = np.random.default_rng(0).standard_normal((1024, 4096), dtype=np.float32) * 0.02
    out = {}
    for fmt in ("nvfp4", "q6_k", "iq3_s", "bf16"):
        x = w[:64] if fmt == "iq3_s" else w
        t = time.perf_counter()
        codecs.decode(fmt, codecs.encode(fmt, x), x.shape)
        out[fmt] = x.size / (time.perf_counter() - t)
    bits = codecs.bf16_bits(w)
    t = time.perf_counter()
    for _ in range(4):
        codecs.encode("bf16", bits).copy()
    out["passthrough"] = 4 * w.size / (time.perf_counter() - t)
    return out


def write_ceiling(d: Path, nbytes: int = 256 << 20) -> float:
    """Bytes/s of a sequential write + fsync into the work folder (what publishing a rank file costs)."""
    buf, f = np.random.default_rng(1).integers(0, 255, nbytes, dtype=np.uint8).tobytes(), d / "io-probe"
    t = time.perf_counter()
    with open(f, "wb") as fh:
        fh.write(buf)
        fh.flush()
        os.fsync(fh.fileno())
    bw = nbytes / (time.perf_counter() - t)
    f.unlink()
    return bw


def ideal_core_seconds(report: dict, ceiling: dict[str, float]) -> float:
    total = 0.0
    for t in report["tensors"].values():
        n = int(np.prod(t["shape"]))
        total += n / ceiling["passthrough" if t["format"] == t["source_dtype"] else t["format"]]
    return total


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-j", "--jobs", type=int, default=2)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--recipes", default="nvfp4,q6_k,iq3_s,bf16")
    ap.add_argument("--iq3s-full", action="store_true", help="whole iq3_s recipe (slow, see module doc)")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/ninfer-bench"))
    ap.add_argument("--keep", action="store_true", help="keep the converted folders")
    args = ap.parse_args(argv)
    print(f"checkpoint: {args.layers} layers at 27B widths in {args.workdir}", file=sys.stderr)
    t = time.perf_counter()
    src = make_checkpoint(args.workdir / "src", args.layers)
    src_bytes = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    print(f"  {src_bytes / 2**30:.2f} GiB ready in {time.perf_counter() - t:.0f} s", file=sys.stderr)
    rows, ceilings = [], []
    for recipe in args.recipes.split(","):
        overrides = IQ3S_LIGHT if recipe == "iq3_s" and not args.iq3s_full else ()
        out = args.workdir / f"out-{recipe}"
        print(f"converting {recipe} -j {args.jobs} ...", file=sys.stderr)
        before = {**codec_ceiling(), "write_bytes": write_ceiling(args.workdir)}   # the box may be shared:
        r = run_convert(src, out, recipe, args.jobs, overrides)                  # measure around each run
        after = {**codec_ceiling(), "write_bytes": write_ceiling(args.workdir)}
        ceiling = {k: (before[k] + after[k]) / 2 for k in before}
        ceilings.append(ceiling)
        rep = r.pop("report")
        params, ideal = rep["totals"]["params"], ideal_core_seconds(rep, ceiling)
        ideal_wall = max(ideal / args.jobs, rep["totals"]["file_bytes"] / ceiling["write_bytes"])
        largest = max(int(np.prod(t["shape"])) * (4 if t["source_dtype"] == "f32" else 2)
                      for t in rep["tensors"].values())
        rows.append({"recipe": recipe, "overrides": list(overrides), "jobs": args.jobs, "params": params,
                     "out_bytes": rep["totals"]["file_bytes"], "wall_s": round(r["wall_s"], 2),
                     "mw_per_s_per_core": round(params / r["wall_s"] / args.jobs / 1e6, 2),
                     "worker_busy_s": rep["totals"]["seconds"],
                     "mw_per_s_busy_core": round(params / max(rep["totals"]["seconds"], 1e-9) / 1e6, 2),
                     "ideal_core_s": round(ideal, 2), "ideal_wall_s": round(ideal_wall, 2),
                     "ratio_to_ceiling": round(ideal_wall / r["wall_s"], 3),
                     "max_process_rss_gib": round(r["max_process_rss"] / 2**30, 2),
                     "tree_rss_peak_gib": round(r["tree_rss_peak"] / 2**30, 2),
                     "tree_anon_rss_peak_gib": round(r["tree_anon_rss_peak"] / 2**30, 2),
                     "codec_ceiling_mw_per_s_core": {k: round(v / 1e6, 2) for k, v in ceiling.items()},
                     "largest_tensor_gib": round(largest / 2**30, 2),
                     "bits_per_weight": rep["totals"]["bits_per_weight"]})
        if not args.keep:
            shutil.rmtree(out, ignore_errors=True)
    _print(rows, ceilings)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    self_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    RESULTS.write_text(json.dumps({"widths": WIDTHS, "layers": args.layers, "source_bytes": src_bytes,
                                   "cpu_count": os.cpu_count(), "bench_self_rss_gib": round(self_rss / 2**30, 2),
                                   "runs": rows}, indent=1) + "\n")
    print(f"wrote {RESULTS}", file=sys.stderr)
    return 0


def _print(rows, ceilings) -> None:
    for r, c in zip(rows, ceilings):
        print(f"{r['recipe']}: codec ceiling (M weights/s, 1 core, encode+decode) "
              + ", ".join(f"{k} {v / 1e6:.1f}" for k, v in c.items() if k != "write_bytes")
              + f"; write {c['write_bytes'] / 2**20:.0f} MiB/s")
    hdr = f"{'recipe':8} {'params':>14} {'GiB out':>8} {'wall s':>8} {'Mw/s/core':>10} {'busy':>8} {'vs ceil':>8} " \
          f"{'maxRSS':>7} {'treeRSS':>8} {'treeAnon':>9} {'largest':>8}   (memory in GiB)"
    print(hdr)
    for r in rows:
        print(f"{r['recipe']:8} {r['params']:>14,} {r['out_bytes'] / 2**30:>8.2f} {r['wall_s']:>8.1f} "
              f"{r['mw_per_s_per_core']:>10.2f} {r['mw_per_s_busy_core']:>8.2f} {r['ratio_to_ceiling']:>8.2f} "
              f"{r['max_process_rss_gib']:>7.2f} {r['tree_rss_peak_gib']:>8.2f} {r['tree_anon_rss_peak_gib']:>9.2f} "
              f"{r['largest_tensor_gib']:>8.2f}")


if __name__ == "__main__":
    sys.exit(main())
