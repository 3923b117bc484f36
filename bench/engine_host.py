"""The host's own time in an MTP round of the real Engine, on the CPU: step bodies that compute nothing.

On the GPU a round is verify + drafts + the re-alignment, plus whatever host work the GPU waits for. This runs the
real Engine, scheduler, rigged verdicts (bench/engine_mtp.py) and the graph runner in eager mode, but every
graph body hands back fixed random outputs of the shapes the captured graph returns instead of computing. What
is left is host work: the Python, the metadata fills, the small torch calls on host tensors (each stands in for a
kernel launch). The round is cut into four windows, by when the runner is asked for each step:

  verdict->align    the verdict read back -> the re-alignment launched: the GPU idles for all of it
  align->next       -> the next step launched (the first draft step; at K = 1 the verify): hidden under the
                    alignment unless the host waits for the GPU in it
  next->verify      -> the verify launched (0 at K = 1): hidden while the host keeps ahead of the draft steps
  verify->verdict   -> the verdict read back: the part after the verify ends is GPU idle time
With round graphs (`--round-graphs 1`, the runtime's default: ninfer_rt/graph_round.py) the draft steps and the
verify are one graph, so `next` is the round itself and next->verify is 0.

Ceiling in the same run: the time of one tiny torch call (`torch_op_us`); `round_in_ops` = us_round / torch_op_us
(the round as a count of tiny calls, to carry the number to another host).

    python3 bench/engine_host.py [--ks 1,3,5] [--acceptance 0.75,1] [--new-tokens 512] [--round-graphs 0]
                                 [--temperature 0.8] [--batch 4]

Records (--out, default bench/results/engine_host.json): {"kind": "engine_host", "draft_tokens", "acceptance",
"rounds", "emitted", "tokens_per_round", "us_round", "windows_us": {window: median}, "torch_op_us",
"round_in_ops", "cpu", "vocab", "hidden", "tag", "round_graphs", "sampled_rounds" (NINFER_SAMPLED_ROUNDS with round
graphs: ninfer_rt/graph_round_sampled.py), "temperature", "batch"}; at --batch B a round is
one engine step of the B requests (us_round per step, "rounds" counts each request's).
"""
from __future__ import annotations

import platform
import random
import statistics
import sys
import time
from pathlib import Path

import synth_artifact as synth
from bench_cli import ArgParser, positive_int
from engine_mtp import _floats, generate, make_rigged, round_graphs_on
from ninfer_formats.atomic import write_json_atomic
from ninfer_formats.errors import NinferError

OUT = Path(__file__).resolve().parent / "results" / "engine_host.json"
WINDOWS = ("verdict->align", "align->next", "next->verify", "verify->verdict")


def parse_args(argv=None):
    ap = ArgParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ks", default="1,3,5", help="draft tokens per round")
    ap.add_argument("--acceptance", default="0.75,1", help="per-position acceptance rates in [0, 1]")
    ap.add_argument("--new-tokens", type=positive_int, default=512)
    ap.add_argument("--dir", default="/tmp/ninfer-engine-host", help="the tiny artifact's folder")
    ap.add_argument("--tag", default="", help="a label kept in the records (e.g. the revision)")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--round-graphs", type=int, choices=(0, 1), default=None,
                    help="1: a round's drafts and verify as one graph (default: NINFER_ROUND_GRAPHS, else 1)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sample every request at this temperature (seeded; default 0: greedy), as engine_mtp's")
    ap.add_argument("--batch", type=positive_int, default=1, help="requests decoded together (default 1)")
    args = ap.parse_args(argv)
    if not 0 <= args.temperature <= 10:
        ap.error(f"--temperature: expected a number in [0, 10], got {args.temperature}")
    try:
        args.ks = tuple(sorted({int(k) for k in args.ks.split(",") if k.strip()}))
        assert args.ks and all(1 <= k <= 7 for k in args.ks)
        args.acceptance = _floats(args.acceptance)
    except (ValueError, AssertionError):
        ap.error(f"--ks / --acceptance: expected integers in 1..7 and rates in [0, 1], got {args.ks!r}, "
                 f"{args.acceptance!r}")
    return args


def null_runner(marks: list):
    """Patch the graph runner class: bodies return fixed outputs, every step request is marked. -> a function
    that restores it (the patch must not outlive the measurement: the tests share the process)."""
    import inspect

    import torch

    from ninfer_rt import graph_model
    from ninfer_rt.graphs import GraphRunner
    fixed: dict = {}
    # a t > 1 MTP graph keeps each row's last logits only where mtp_step takes t (an earlier runtime: all rows)
    last_only = "t" in inspect.signature(graph_model.mtp_step).parameters

    def body(self, key, host):
        kind, b, t, _ = key
        if key not in fixed:
            g = torch.Generator().manual_seed(b * 31 + t)
            rnd = kind in ("round", "sround", "tround")            # greedy, sampled (graph_round_sampled)
            n = b * (t + 1) if rnd else b * t                       # a round of t drafts verifies t + 1 tokens
            rows = b if kind == "mtp" and t > 1 and last_only else n
            fixed[key] = (torch.randn(n, self.model.cfg.hidden_size, generator=g),
                          torch.randn(rows, self.model.cfg.vocab_size, generator=g))
            if rnd:                     # the packed drafts and verify argmax (and a sampled round's verdicts)
                fixed[key] += (torch.zeros(b * t + n + 2 * b * (kind != "round"), dtype=torch.long),)
        return fixed[key]

    real_body, real_run = GraphRunner._body, GraphRunner._run

    def run(self, key, rows, *more):
        marks.append((key[0], time.perf_counter()))
        return real_run(self, key, rows, *more)

    def restore():
        GraphRunner._body, GraphRunner._run = real_body, real_run
    GraphRunner._body, GraphRunner._run = body, run
    return restore


def windows(marks: list) -> dict:
    """Median of each window over the rounds whose marks are complete: a verdict, the alignment, the next step
    (the first draft step; the verify itself at K = 1), the verify, the next verdict."""
    got = {w: [] for w in WINDOWS}
    for i, (kind, _) in enumerate(marks):
        if kind != "verdict" or i + 2 >= len(marks) or marks[i + 1][0] != "mtp":
            continue
        ver = next((j for j in range(i + 2, len(marks)) if marks[j][0] != "mtp"), None)
        if ver is None or marks[ver][0] not in ("target", "round", "sround", "tround") or ver + 1 >= len(marks) \
                or marks[ver + 1][0] != "verdict":
            continue
        for w, (a, b) in zip(WINDOWS, ((i, i + 1), (i + 1, i + 2), (i + 2, ver), (ver, ver + 1))):
            got[w].append(marks[b][1] - marks[a][1])
    return {w: round(statistics.median(v) * 1e6, 1) for w, v in got.items() if v}


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), platform.machine())
    except OSError:
        return platform.processor() or platform.machine()


def torch_op_us() -> float:
    """Median us of one tiny torch call (an in-place add on one element): the unit of host work."""
    import torch
    x = torch.zeros(1)
    times = []
    for _ in range(2000):
        t = time.perf_counter()
        x.add_(1)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def _engine(loaded, k: int, marks: list, round_graphs: bool, batch: int = 1):
    from ninfer_rt.backends import get_ops
    from ninfer_rt.engine import Engine
    from ninfer_rt.graphs import GraphConfig
    from ninfer_rt.speculative import SpecConfig
    cls = make_rigged(Engine)
    real = cls._rigged_rows

    def rows(self, r):
        out = real(self, r)
        marks.append(("verdict", time.perf_counter()))
        return out
    cls._rigged_rows = rows
    cfg = GraphConfig(batch_sizes=(batch,), tokens=tuple(range(1, k + 2)), mtp_tokens=tuple(range(1, k + 2)),
                      kv_buckets=(4096,), eager=True,       # the shapes `graph_config` gives a CUDA engine
                      **({"round_drafts": k, "sampled_rounds": sampled_rounds_on()} if round_graphs else {}))
    return cls(loaded, get_ops("torch"), spec=SpecConfig(num_draft_tokens=k), max_batch=batch, max_model_len=4096,
               graphs=cfg)


def sampled_rounds_on() -> bool:
    """NINFER_SAMPLED_ROUNDS as the runtime reads it (False for a runtime without sampled round graphs)."""
    try:
        from ninfer_rt.engine_layout import sampled_rounds
    except ImportError:
        return False
    return sampled_rounds()


def round_graphs(args) -> bool:
    """--round-graphs, else the runtime's own choice (NINFER_ROUND_GRAPHS; False for a runtime without them)."""
    return bool(args.round_graphs) if args.round_graphs is not None else round_graphs_on()


def measure(loaded, args) -> list[dict]:
    marks: list = []
    restore = null_runner(marks)
    try:
        return _measure(loaded, args, marks)
    finally:
        restore()


def _measure(loaded, args, marks: list) -> list[dict]:
    unit = torch_op_us()
    prompt = random.Random(0).choices(range(min(loaded.config.vocab_size, 1000)), k=64)
    base = {"kind": "engine_host", "cpu": cpu_name(), "tag": args.tag, "round_graphs": round_graphs(args),
            "sampled_rounds": round_graphs(args) and sampled_rounds_on(),
            "temperature": args.temperature, "batch": args.batch,
            "vocab": loaded.config.vocab_size, "hidden": loaded.config.hidden_size, "torch_op_us": round(unit, 3)}
    out = []
    for k in args.ks:
        eng = _engine(loaded, k, marks, base["round_graphs"], args.batch)
        eng.temperature = args.temperature                                   # engine_mtp.request_params reads it
        generate(eng, prompt, 32, args.batch)                                # warm-up
        for a in args.acceptance:
            eng.rate, eng.rng = a, random.Random(0)
            marks.clear()
            run = generate(eng, prompt, args.new_tokens, args.batch)
            secs, n, acc = run.secs, run.spec["rounds"], run.spec["accepted"]
            us = secs / max(1, n if args.batch == 1 else run.steps) * 1e6   # a batch's round: one step
            out.append({**base, "draft_tokens": k, "acceptance": a, "rounds": n, "emitted": len(run.tokens[0]),
                        "tokens_per_round": round(1 + acc / max(1, n), 3), "us_round": round(us, 1),
                        "windows_us": windows(marks), "round_in_ops": round(us / unit, 1)})
        eng.shutdown()
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        import torch

        from ninfer_rt.loader import load
        paths, _ = synth.build(args.dir, synth.TINY, "nvfp4", 1, log=lambda m: None)
        loaded = load(paths[0], device=torch.device("cpu"), dtype=torch.float32)
        records = measure(loaded, args)
        loaded.close()
        write_json_atomic(args.out, records)
    except (NinferError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{'K':>2} {'accept':>6} {'tok/round':>9} {'us/round':>9} " + " ".join(f"{w:>16}" for w in WINDOWS))
    for r in records:
        w = r["windows_us"]
        print(f"{r['draft_tokens']:>2} {r['acceptance']:>6g} {r['tokens_per_round']:>9.2f} {r['us_round']:>9.1f} "
              + " ".join(f"{w.get(x, float('nan')):>16.1f}" for x in WINDOWS))
    print(f"torch_op_us {records[0]['torch_op_us']:.3f} (one tiny torch call); wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
