"""Serving throughput: aggregate decode tok/s at concurrency 1, 2, 4, 8 over HTTP, against its own ceiling.

Measured in the same run, on the same loaded model:
  direct   the Engine driven in-process (c requests added at once, step() until done): the ceiling
  http     `ninfer-rt serve`'s app (uvicorn + scheduler thread, in this process) with c concurrent streaming
           clients in a separate process (so client work does not share this process's GIL)
Per request: prompt of --prompt-tokens random ids, --max-tokens completion tokens (ignore_eos, greedy).
agg_tok_s = sum(tokens after the first) / (last token of any request - first token of any request);
itl = a request's (last - first token time) / (tokens - 1); ttft from the request's arrival. Over HTTP the
token times are the scheduler's (its JSONL request log: when each request's first and last token were
emitted to its stream); `client_*` fields repeat the numbers from SSE chunk arrival at the client, which
run early or late where the detokenizer holds text back (random ids, a partial UTF-8 character, ids the
tokenizer has no text for), so they are kept for reference only. `requests` / `completion_tokens` say what
the numbers were taken over (every request runs to --max-tokens). Each level runs --waves waves of c requests
(direct and over HTTP); a record is the wave with the median aggregate rate, `agg_tok_s_waves` lists them all.

    python bench/serve.py --artifact DIR [--concurrency 1,2,4,8] [--max-tokens 128] [--prompt-tokens 128] [--waves 3]
                          [--spec none|mtp] [--draft-tokens 3] [--tp 1] [--device cpu|cuda]
                          [--dtype float32|bfloat16|float16] [--backend torch|triton] [--timeout-s 1800]
                          [--out bench/results/serve.json] [--json]

Prints a table (or the records as JSON with --json) and writes them to --out (default
bench/results/serve.json); a concurrency level whose clients take longer than --timeout-s fails the run.
Exit status 0, 2 on bad arguments or a failed run (one `error:` line, nothing written).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench_cli import ArgParser, int_list, nonneg_int, positive_int
from ninfer_formats.atomic import write_json_atomic
from ninfer_formats.errors import NinferError

OUT = Path(__file__).resolve().parent / "results" / "serve.json"
DTYPES = ("float32", "bfloat16", "float16")
LOG_WAIT_S = 10.0          # the scheduler logs a request after queuing its last chunk: the client can be first
SERVER_START_S = 30.0


class RunFailed(Exception):
    """The HTTP side did not start or answer (one line: what and why)."""


# ---- client side (runs in a child process) --------------------------------------------------------------

async def _one(client, body: dict) -> dict:
    t0 = time.perf_counter()
    first = last = None
    tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            now = time.perf_counter()
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            choice = (chunk.get("choices") or [{}])[0]
            if choice.get("text") and first is None:
                first = now
            if choice.get("finish_reason"):       # sent right after the last token, text or not
                last = now
                first = first if first is not None else now
    if last is None:
        raise RuntimeError("the stream ended without a finish_reason")
    return {"start": t0, "first": first, "last": last, "tokens": tokens}


async def _clients(url: str, prompts: list[list[int]], max_tokens: int, timeout_s: float) -> list[dict]:
    import httpx
    limits = httpx.Limits(max_connections=len(prompts) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits) as client:
        bodies = [{"prompt": p, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
                   "stream_options": {"include_usage": True}} for p in prompts]
        return await asyncio.gather(*[_one(client, b) for b in bodies])


def client_main(args) -> int:
    spec = json.loads(sys.stdin.read())
    print(json.dumps(asyncio.run(_clients(args.client, spec["prompts"], spec["max_tokens"], args.timeout_s))))
    return 0


# ---- measurement ----------------------------------------------------------------------------------------

def summarize(reqs: list[dict]) -> dict:
    """Aggregate decode rate and medians from per-request {start, first, last, tokens} (seconds)."""
    firsts = [r["first"] for r in reqs]
    lasts = [r["last"] for r in reqs]
    span = max(lasts) - min(firsts)
    decoded = sum(r["tokens"] - 1 for r in reqs)
    itl = [(r["last"] - r["first"]) / (r["tokens"] - 1) for r in reqs if r["tokens"] > 1]
    return {"agg_tok_s": decoded / span if span > 0 else 0.0,
            "ttft_ms_p50": 1e3 * statistics.median(r["first"] - r["start"] for r in reqs),
            "itl_ms_p50": 1e3 * statistics.median(itl) if itl else None,
            # how far apart the requests' first tokens came: a request that started decoding alone waits out the
            # others' prefill inside its own span (and the aggregate's)
            "first_spread_ms": 1e3 * (max(firsts) - min(firsts)),
            "requests": len(reqs), "completion_tokens": sum(r["tokens"] for r in reqs)}


def median_wave(waves: list[dict]) -> dict:
    """The wave with the median aggregate rate (one ~1 s wave can lose a fifth to a single stall; the median of
    several does not), with every wave's rate (and engine step counters) beside it."""
    ranked = sorted(waves, key=lambda w: w["agg_tok_s"])
    return {**ranked[(len(ranked) - 1) // 2], "agg_tok_s_waves": [w["agg_tok_s"] for w in waves],
            "itl_ms_p50_waves": [w.get("itl_ms_p50") for w in waves],
            "first_spread_ms_waves": [w.get("first_spread_ms") for w in waves],
            "engine_waves": [w.get("engine") for w in waves]}


def engine_counts(engine) -> dict:
    """The engine's step counters (`EngineStats`, its GraphRunner's): what each wave's steps were."""
    st, g = engine.stats, engine.stats.graphs
    return {"steps": st.steps, "ahead_steps": st.ahead_steps, "decode_batches": dict(st.decode_batches),
            "graph_replays": g.replays if g is not None else 0,
            "graph_fallbacks": dict(g.reasons) if g is not None else {}}


def counts_since(engine, before: dict) -> dict:
    """`engine_counts` now minus `before` (per key for the dicts, zeros dropped)."""
    now, out = engine_counts(engine), {}
    for k, v in now.items():
        if isinstance(v, dict):
            out[k] = {str(b): n - before[k].get(b, 0) for b, n in sorted(v.items()) if n - before[k].get(b, 0)}
        else:
            out[k] = v - before[k]
    return out


def in_engine_thread(fn, init):
    """Run fn in a fresh thread, as the server's scheduler does (torch's per-thread state and CPU thread
    pools differ between the main thread and others, so the ceiling is measured under the same conditions)."""
    box = {}

    def body():
        init()
        try:
            box["out"] = fn()
        except BaseException as e:
            box["err"] = e
    t = threading.Thread(target=body)
    t.start()
    t.join()
    if "err" in box:
        raise box["err"]
    return box["out"]


def run_direct(engine, prompts, max_tokens: int, sync) -> dict:
    from ninfer_rt.sampling import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    reqs = {f"d{i}": {"start": t0, "first": None, "last": None, "tokens": 0} for i in range(len(prompts))}
    for rid, p in zip(reqs, prompts):
        engine.add_request(rid, p, params)
    while engine.has_work():
        outs = engine.step()
        sync()
        now = time.perf_counter()
        for o in outs:
            r = reqs[o.req_id]
            if o.new_token_ids:
                r["first"] = r["first"] if r["first"] is not None else now
                r["last"], r["tokens"] = now, r["tokens"] + len(o.new_token_ids)
    return summarize(list(reqs.values()))


def run_http(url: str, prompts, max_tokens: int, timeout_s: float) -> dict:
    cmd = [sys.executable, __file__, "--client", url, "--timeout-s", str(timeout_s)]
    try:
        proc = subprocess.run(cmd, input=json.dumps({"prompts": prompts, "max_tokens": max_tokens}),
                              capture_output=True, text=True, check=False, timeout=timeout_s + 30)
    except subprocess.TimeoutExpired:          # subprocess.run has killed it
        raise RunFailed(f"{len(prompts)} HTTP clients did not finish in {timeout_s:.0f} s") from None
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise RunFailed(f"client process failed (exit code {proc.returncode}): {last}")
    return summarize(json.loads(proc.stdout))


def thread_init(rt):
    import torch
    dev = rt.engine.device

    def init():
        torch.set_grad_enabled(False)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
    return init


def done_events(log_path: str) -> list[dict]:
    """The `request_done` events of the server's request log, whole lines only."""
    with open(log_path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.endswith("\n") and '"request_done"' in line]


def server_side(log_path: str, start: int, n: int, wait_s: float = LOG_WAIT_S) -> dict:
    """summarize() over `request_done` events start..start+n: token emission times as the scheduler saw them
    (absolute first/last token = event time - total + ttft, + decode)."""
    deadline = time.monotonic() + wait_s
    while len(done := done_events(log_path)) < start + n:
        if time.monotonic() > deadline:
            raise RunFailed(f"the server logged {len(done) - start} of {n} finished requests in {wait_s:.0f} s")
        time.sleep(0.05)
    reqs = []
    for e in done[start:start + n]:
        t = e["timings_seconds"]
        arrival = e["time"] - t["total"]
        first = arrival + t["ttft"]
        reqs.append({"start": arrival, "first": first, "last": first + (t["decode"] or 0.0),
                     "tokens": e["completion_tokens"]})
    return summarize(reqs)


def start_server(rt, max_concurrency: int, log_path: str):
    import socket

    import uvicorn

    from ninfer_rt.server import ServerState, create_app
    from ninfer_rt.server.request_log import RequestLog
    from ninfer_rt.server.scheduler import Scheduler, SchedulerConfig
    state = ServerState(model_id="bench")
    sched = Scheduler(rt.engine, rt.engine.model.kv_pool, rt.tokenizer,
                      SchedulerConfig(max_concurrency=max_concurrency, max_context=rt.max_context, max_pending=1024),
                      state.metrics, log=RequestLog(log_path), thread_init=thread_init(rt))
    sched.start()
    state.ready(sched, rt.tokenizer, rt.loaded.config.vocab_size, {})
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(state), log_level="warning"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    deadline = time.monotonic() + SERVER_START_S
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:     # uvicorn failed to start: say so, not hang
            server.should_exit = True
            sched.stop()
            raise RunFailed(f"the HTTP server did not start in {SERVER_START_S:.0f} s")
        time.sleep(0.01)
    return f"http://127.0.0.1:{sock.getsockname()[1]}", server, sched


def random_prompts(tok, vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    usable = [i for i in range(min(vocab, 50000)) if i not in tok.special_ids]
    return [[rng.choice(usable) for _ in range(length)] for _ in range(n)]


def parse_args(argv=None):
    ap = ArgParser(description=__doc__.splitlines()[0])
    ap.add_argument("--artifact", help="artifact folder (e.g. the 27B-shaped one bench/decode.py builds)")
    ap.add_argument("--concurrency", type=int_list, default=(1, 2, 4, 8))
    ap.add_argument("--max-tokens", type=positive_int, default=128, help="at least 2 (rates count the tokens "
                                                                          "after each request's first)")
    ap.add_argument("--prompt-tokens", type=positive_int, default=128)
    ap.add_argument("--waves", type=positive_int, default=3, help="waves of requests per concurrency level; "
                    "the records keep the median wave (by aggregate rate) and list every wave's rate")
    ap.add_argument("--spec", choices=["none", "mtp"], default="none")
    ap.add_argument("--draft-tokens", type=positive_int, default=3)
    ap.add_argument("--tp", type=positive_int, default=1)
    ap.add_argument("--device", choices=["cpu", "cuda"], default=None)
    ap.add_argument("--dtype", choices=DTYPES, default=None, help="default bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--backend", choices=("torch", "triton"), default=None, help="default triton on cuda, torch on cpu")
    ap.add_argument("--timeout-s", type=float, default=1800.0, help="per concurrency level over HTTP")
    ap.add_argument("--prefix-cache-entries", type=nonneg_int, default=0,
                    help="the server's prefix cache (default 0, off: the HTTP waves send the direct runs' prompts, "
                         "which would resume from their entries)")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--json", action="store_true", help="print the records as JSON instead of a table")
    ap.add_argument("--client", help=argparse.SUPPRESS)       # internal: client process mode
    args = ap.parse_args(argv)
    if not args.client and not args.artifact:
        ap.error("--artifact is required")
    if args.max_tokens < 2:
        ap.error(f"--max-tokens {args.max_tokens}: at least 2 (rates count the tokens after each request's first)")
    if not args.timeout_s > 0:
        ap.error(f"--timeout-s {args.timeout_s}: expected a positive number of seconds")
    return args


def _direct_levels(rt, args, levels, prompts) -> dict:
    import torch
    dev = rt.engine.device
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    run_direct(rt.engine, prompts(1, 99), 8, sync)                                              # warm-up

    def wave(c: int, w: int) -> dict:
        before = engine_counts(rt.engine)
        out = run_direct(rt.engine, prompts(c, c + 1000 * w), args.max_tokens, sync)
        return {**out, "engine": counts_since(rt.engine, before)}
    return {c: median_wave([wave(c, w) for w in range(args.waves)]) for c in levels}


def _http_levels(rt, args, levels, prompts, log_path: str) -> dict:
    """{c: (server-side summary, client-side summary)}; the server is stopped on the way out, also on error."""
    url, server, sched = start_server(rt, max(levels), log_path)
    try:
        run_http(url, prompts(1, 99), 8, args.timeout_s)                                        # warm-up
        out = {}
        for c in levels:
            waves = []
            for w in range(args.waves):
                seen, before = len(done_events(log_path)), engine_counts(rt.engine)
                client = run_http(url, prompts(c, c + 1000 * w), args.max_tokens, args.timeout_s)
                waves.append({**server_side(log_path, seen, c), "client": client,
                              "engine": counts_since(rt.engine, before)})
            med = median_wave(waves)
            out[c] = {k: v for k, v in med.items() if k != "client"}, med["client"]
        return out
    finally:
        server.should_exit = True
        sched.stop()


def _record(c: int, server: dict, client: dict, direct: dict, gpu: str, args) -> dict:
    return {"concurrency": c, **server, "gpu": gpu, "direct_agg_tok_s": direct["agg_tok_s"],
            **{f"client_{k}": v for k, v in client.items()}, "direct_itl_ms_p50": direct["itl_ms_p50"],
            "direct_engine": direct["engine"],
            "ratio_to_direct": server["agg_tok_s"] / direct["agg_tok_s"] if direct["agg_tok_s"] else None,
            "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
            "draft_tokens": args.draft_tokens if args.spec == "mtp" else 0, "tp": args.tp, "waves": args.waves,
            "prefix_cache": args.prefix_cache_entries, "artifact": os.path.abspath(args.artifact)}


def measure(args) -> list[dict]:
    import torch

    from bench_device import device_name
    from ninfer_rt.server.runtime import RuntimeOptions, open_runtime
    levels = sorted(set(args.concurrency))
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    ctx = args.prompt_tokens + args.max_tokens + 16
    rt = open_runtime(RuntimeOptions(
        artifact=args.artifact, tp=args.tp, device=device,
        dtype=args.dtype or ("bfloat16" if device == "cuda" else "float32"),
        backend=args.backend or ("triton" if device == "cuda" else "torch"),
        draft_tokens=args.draft_tokens if args.spec == "mtp" else 0, max_concurrency=max(levels),
        kv_capacity=max(levels) * ctx, max_context=ctx, prefix_cache=args.prefix_cache_entries))
    vocab = rt.loaded.config.vocab_size

    def prompts(n: int, seed: int) -> list[list[int]]:
        return random_prompts(rt.tokenizer, vocab, n, args.prompt_tokens, seed)
    try:
        gpu = device_name(rt.engine.device)
        direct = in_engine_thread(lambda: _direct_levels(rt, args, levels, prompts), thread_init(rt))
        with tempfile.TemporaryDirectory(prefix="ninfer-serve-bench-") as tmp:
            http = _http_levels(rt, args, levels, prompts, os.path.join(tmp, "requests.jsonl"))
    finally:
        rt.close()
    return [_record(c, *http[c], direct[c], gpu, args) for c in levels]


def _batches(counts: dict) -> str:
    """'4x63 1x2': decode steps per batch size, and how many ran ahead of the host."""
    return " ".join(f"{b}x{n}" for b, n in counts["decode_batches"].items()) + f" ({counts['ahead_steps']} ahead)"


def table(records: list[dict]) -> str:
    lines = [f"{'conc':>4} {'http tok/s':>11} {'direct tok/s':>13} {'ratio':>6} {'ttft p50 ms':>12} {'itl p50 ms':>11}"
             f"  decode steps per batch size: http | direct"]
    for r in records:
        ratio = f"{r['ratio_to_direct']:.2f}" if r["ratio_to_direct"] is not None else "-"
        itl = f"{r['itl_ms_p50']:.2f}" if r["itl_ms_p50"] is not None else "-"
        lines.append(f"{r['concurrency']:>4} {r['agg_tok_s']:>11.1f} {r['direct_agg_tok_s']:>13.1f} {ratio:>6} "
                     f"{r['ttft_ms_p50']:>12.1f} {itl:>11}  {_batches(r['engine'])} | {_batches(r['direct_engine'])}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.client:
        return client_main(args)
    try:
        records = measure(args)
        write_json_atomic(args.out, records)
    except (NinferError, OSError, RunFailed) as e:      # bad input or the HTTP side failing: one line
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(records, indent=1) if args.json else table(records))
    print(f"gpu: {records[0]['gpu']}; wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
