"""Prefix caching's time to first token through the real Engine on a 27B-shaped artifact.

For each prompt length L of --prompt-lens, an Engine with the prefix cache (--entries) and one without, on one
loaded model, each request greedy with one new token (so the time is the prompt's prefill and its first token):
  cold    a fresh prompt on the cached engine: its prefill also stops at its entry point (the cache's extra cut)
  repeat  that prompt again: it resumes at its last page boundary before the final token
  shared  prompts of one --system-token system prompt and their own random tails: after two of them the third
          resumes where they part (the last page boundary of the system prompt)
Ceilings measured in the same run: `off_ms`, the same prompt on the engine without the cache; `tail_ms`, a fresh
prompt of just the uncached tokens (L - cached_tokens) on that engine, the least a resumed request can cost.
Each time is the median of --reps requests (fresh random prompts per rep; the shared case's system prompt too).

    python3 bench/prefix_cache.py [--recipe nvfp4] [--prompt-lens 1024,4096] [--system 768] [--reps 3]
    python3 bench/prefix_cache.py --tiny --device cpu --prompt-lens 48 --system 24 --reps 1    # CPU dry run

Records (--out, default bench/results/prefix_cache.json): {"kind": "prefix_cache", "recipe", "gpu", "backend",
"graphs", "entries", "prompt_tokens", "case" (cold | repeat | shared), "cached_tokens", "ttft_ms", "off_ms",
"tail_ms" (None for cold), "speedup" (off_ms / ttft_ms), "ratio_to_tail" (tail_ms / ttft_ms: 1 = the resume
costs nothing beyond the uncached tokens), "token_match" (the fraction of reps whose greedy first token is the
uncached engine's: random weights leave close logits, so bf16 rounding may flip a few), "prefill_graphs"
(NINFER_PREFILL_GRAPHS)}.
"""
from __future__ import annotations

import os
import random
import statistics
import sys
import time
from pathlib import Path

import synth_artifact as synth
from bench_cli import ArgParser, int_list, positive_int
from ninfer_formats.atomic import write_json_atomic
from ninfer_formats.errors import NinferError

OUT = Path(__file__).resolve().parent / "results" / "prefix_cache.json"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def parse_args(argv=None):
    ap = ArgParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="nvfp4", help="synthetic artifact recipe (nvfp4, q6_k, iq3_s, bf16)")
    ap.add_argument("--prompt-lens", type=int_list, default=(1024, 4096))
    ap.add_argument("--system", type=positive_int, default=768, help="system prompt tokens of the shared case")
    ap.add_argument("--entries", type=positive_int, default=16, help="prefix cache entries")
    ap.add_argument("--reps", type=positive_int, default=3)
    synth.add_engine_args(ap, OUT)
    args = ap.parse_args(argv)
    if any(n <= args.system + 16 for n in args.prompt_lens):
        ap.error(f"--prompt-lens: each must exceed --system ({args.system}) by more than a KV page (16 tokens)")
    return args


def ttft_ms(eng, prompt: list[int], tag: str) -> tuple[float, int, int]:
    """(ms to the first token, prompt tokens resumed from the cache, the token) of one greedy one-token request."""
    import torch

    from ninfer_rt.sampling import SamplingParams
    if eng.device.type == "cuda":
        torch.cuda.synchronize(eng.device)
    t0 = time.perf_counter()
    eng.add_request(tag, prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    cached, token = 0, -1
    while eng.has_work():
        for o in eng.step():
            cached = max(cached, o.cached_tokens)
            token = o.new_token_ids[0] if o.new_token_ids else token
    if eng.device.type == "cuda":
        torch.cuda.synchronize(eng.device)
    return (time.perf_counter() - t0) * 1e3, cached, token


class Bench:
    def __init__(self, on, off, vocab: int, seed: int):
        self.on, self.off, self.n = on, off, 0
        self.rng = random.Random(seed)
        self.vocab = min(vocab, 4096)

    def fresh(self, n: int) -> list[int]:
        return [self.rng.randrange(self.vocab) for _ in range(n)]

    def time(self, eng, prompt: list[int]) -> tuple[float, int, int]:
        self.n += 1
        return ttft_ms(eng, prompt, f"q{self.n}")

    def rep(self, length: int, system: int) -> dict[str, tuple[float, float, float | None, int, bool]]:
        """One rep of every case: case -> (ttft_ms, off_ms, tail_ms, cached_tokens, whether the first token is
        the uncached engine's)."""
        p = self.fresh(length)
        cold, _, tok = self.time(self.on, p)
        off, _, ref = self.time(self.off, p)
        out = {"cold": (cold, off, None, 0, tok == ref)}
        warm, cached, tok = self.time(self.on, p)
        out["repeat"] = (warm, off, self.time(self.off, self.fresh(length - cached))[0], cached, tok == ref)
        s = self.fresh(system)
        for _ in range(2):
            self.time(self.on, s + self.fresh(length - system))
        q = s + self.fresh(length - system)
        got, cached, tok = self.time(self.on, q)
        tail = self.time(self.off, self.fresh(length - cached))[0] if cached else None
        off, _, ref = self.time(self.off, q)
        out["shared"] = (got, off, tail, cached, tok == ref)
        return out


def measure(args, path: str) -> list[dict]:
    import torch

    import bench_device as D
    from ninfer_rt.backends import get_ops
    from ninfer_rt.engine import Engine
    from ninfer_rt.loader import load
    device = torch.device(args.device)
    loaded = load(path, device=device, dtype=torch.bfloat16 if args.device == "cuda" else torch.float32)
    backend = args.backend or ("triton" if args.device == "cuda" else "torch")
    top = max(args.prompt_lens) + 32
    graphs = "eager" if args.eager or args.device != "cuda" else "auto"
    engines = [Engine(loaded, get_ops(backend), max_batch=1, kv_pages=3 * top // 16 + 8, max_model_len=top,
                      prefill_chunk=512, graphs=graphs, prefix_cache=n) for n in (args.entries, 0)]
    b = Bench(*engines, loaded.config.vocab_size, args.seed)
    base = {"kind": "prefix_cache", "recipe": args.recipe, "gpu": D.device_name(device), "backend": backend,
            "graphs": graphs == "auto", "entries": args.entries,
            "prefill_graphs": os.environ.get("NINFER_PREFILL_GRAPHS", "1") == "1"}
    records = []
    try:
        for length in args.prompt_lens:
            b.rep(length, args.system)                                  # warm-up: compiles, tunes
            reps = [b.rep(length, args.system) for _ in range(args.reps)]
            for case in ("cold", "repeat", "shared"):
                records.append(_record(base, length, case, [r[case] for r in reps]))
                log(_line(records[-1]))
    finally:
        for e in engines:
            e.shutdown()
        loaded.close()
    return records


def _record(base: dict, length: int, case: str, runs: list[tuple]) -> dict:
    ttft = statistics.median(r[0] for r in runs)
    off = statistics.median(r[1] for r in runs)
    tails = [r[2] for r in runs if r[2] is not None]
    tail = statistics.median(tails) if tails else None
    return {**base, "prompt_tokens": length, "case": case, "cached_tokens": min(r[3] for r in runs),
            "ttft_ms": ttft, "off_ms": off, "tail_ms": tail, "speedup": off / ttft,
            "ratio_to_tail": tail / ttft if tail is not None else None,
            "token_match": sum(r[4] for r in runs) / len(runs)}


def _line(r: dict) -> str:
    tail = "-" if r["tail_ms"] is None else f"{r['tail_ms']:.1f}"
    ratio = "-" if r["ratio_to_tail"] is None else f"{r['ratio_to_tail']:.2f}"
    return (f"{r['prompt_tokens']:>7} {r['case']:<7} {r['cached_tokens']:>7} {r['ttft_ms']:>9.1f} {r['off_ms']:>9.1f} "
            f"{tail:>9} {r['speedup']:>7.2f} {ratio:>6} {r['token_match']:>5.2f}")


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        records = measure(args, synth.engine_artifact(args, log))
        write_json_atomic(args.out, records)
    except (NinferError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{'prompt':>7} {'case':<7} {'cached':>7} {'ttft ms':>9} {'off ms':>9} {'tail ms':>9} {'speedup':>7} "
          f"{'/tail':>6} {'same':>5}")
    for r in records:
        print(_line(r))
    log(f"wrote {args.out}")
    bad = [r for r in records if r["case"] != "cold" and not r["cached_tokens"]]
    if bad:
        print(f"error: {bad[0]['case']} at {bad[0]['prompt_tokens']} tokens resumed nothing from the cache",
              file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
