"""The sampling processing a sampled round graph holds, timed alone: torch.topk of a few 248,320-wide rows against
the chunked selection (`ninfer_rt.sampling_rows.select_top`), and `processed` with and without its selection.

On CUDA each case is captured in a CUDA graph of `--reps` calls and replayed (the time a round graph spends on it,
without launch gaps); elsewhere it runs eagerly. Ceiling in the same run: one copy of the same rows (`copy_us`,
the least any pass over them costs); each record reports its ratio to it.

    python3 bench/topk_select.py [--rows 1,4] [--chunks 1024,2048,4096,8192] [--device cuda]

Records (--out, default bench/results/topk_select.json): {"kind": "topk_select", "case" ("topk", "chunked",
"kernel" (CUDA: ninfer_kernels.topk_select, NINFER_TOPK_KERNEL), "bf16_logits" (torch.topk of the bf16 logits,
then the probabilities at those columns), "processed", "softmax"), "rows", "vocab",
"width", "chunk" (0: torch.topk), "us", "copy_us", "in_copies", "same" (the case's values equal torch.topk's of
the probabilities), "gpu", "device"}.
"""
from __future__ import annotations

import sys
import time

from bench_cli import ArgParser, int_list, positive_int
from ninfer_formats.atomic import write_json_atomic

OUT = "bench/results/topk_select.json"


def parse_args(argv=None):
    ap = ArgParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int_list, default=(1, 4), help="rows per call (a draft step: the batch; a "
                    "verdict: batch x (K + 1))")
    ap.add_argument("--vocab", type=positive_int, default=248320)
    ap.add_argument("--chunks", type=int_list, default=(1024, 2048, 4096, 8192))
    ap.add_argument("--reps", type=positive_int, default=50, help="calls per timing")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=OUT)
    return ap.parse_args(argv)


def timer(fn, reps: int, device):
    """us per call of fn: a CUDA graph of reps calls replayed (CUDA), else eager calls."""
    import torch
    if device.type != "cuda":
        fn()
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t) / reps * 1e6
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) * 1e3 / reps)
    return best


def cases(rows: int, args, device) -> list[dict]:
    import torch

    from ninfer_rt import sampling_rows as S
    g = torch.Generator(device=device).manual_seed(rows)
    logits = torch.randn(rows, args.vocab, generator=g, device=device) * 3
    prm = torch.tensor([[0.8, 20.0, 0.95, 0.0]] * rows, device=device)
    probs = S.softmax_rows(logits / 0.8)
    width = min(S.TOPK_GRAPH_WIDTH, args.vocab)
    want = probs.topk(width)[0]
    copy_us = timer(lambda: probs.clone(), args.reps, device)
    base = {"kind": "topk_select", "rows": rows, "vocab": args.vocab, "width": width, "copy_us": copy_us}
    out = [{**base, "case": "topk", "chunk": 0, "us": timer(lambda: probs.topk(width), args.reps, device),
            "same": True}]
    for c in args.chunks:
        same = bool(torch.equal(S.select_top(probs, width, c)[0], want))
        out.append({**base, "case": "chunked", "chunk": c, "same": same,
                    "us": timer(lambda c=c: S.select_top(probs, width, c), args.reps, device)})
    if device.type == "cuda":
        from ninfer_kernels.topk_select import topk_rows
        same = bool(torch.equal(topk_rows(probs, width)[0], want))
        out.append({**base, "case": "kernel", "chunk": 0, "same": same,
                    "us": timer(lambda: topk_rows(probs, width), args.reps, device)})
    # the selection made on the graph's bf16 logits (16-bit radix keys; softmax keeps their order), then the
    # probabilities gathered at those columns
    lb = logits.to(torch.bfloat16)
    pb = S.softmax_rows(lb / 0.8)
    same = bool(torch.equal(pb.gather(1, lb.topk(width)[1]), pb.topk(width)[0]))
    out.append({**base, "case": "bf16_logits", "chunk": 0, "same": same,
                "us": timer(lambda: pb.gather(1, lb.topk(width)[1]), args.reps, device)})
    out.append({**base, "case": "processed", "chunk": S.TOPK_CHUNK, "same": True,
                "us": timer(lambda: S.processed(logits, prm), args.reps, device)})
    out.append({**base, "case": "softmax", "chunk": 0, "same": True,
                "us": timer(lambda: S.processed(logits, prm, select=False), args.reps, device)})
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda: no CUDA device (use --device cpu for a dry run)", file=sys.stderr)
        return 2
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    records = []
    with torch.no_grad():
        for rows in args.rows:
            records += [{**r, "gpu": gpu, "device": device.type, "in_copies": r["us"] / r["copy_us"]}
                        for r in cases(rows, args, device)]
    write_json_atomic(args.out, records)
    print(f"{'case':>11} {'rows':>4} {'chunk':>5} {'us':>8} {'copies':>6} same")
    for r in records:
        print(f"{r['case']:>11} {r['rows']:>4} {r['chunk']:>5} {r['us']:8.1f} {r['in_copies']:6.1f} {r['same']}")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
