"""MTP speculative decoding through the real Engine on a 27B-shaped artifact, at chosen acceptance rates.

bench/decode.py models MTP throughput from its step times: tokens per round / (verify_K + K * draft). This runs
the Engine itself (CUDA graphs, the host's decisions and read-backs, the MTP alignment pass, the GDN rollback),
so its tok/s includes the host work between the steps that the model leaves out. Random weights draft nothing
useful, so the verdicts are rigged: in each round draft j is accepted with probability `a` while drafts 1..j-1
were (per-position acceptance a, the same model decode.py uses). The drafts, the verify step and its decision
(argmax and read-back) are the real ones; only the accepted count is replaced, so the Engine rolls back,
re-aligns and drafts exactly as it would at that acceptance. (A truth-following rig, drafts set to a K = 0
run's tokens, did not work on the H200 (bench/NOTES.md §38): the text left the K = 0 text within the first rounds
and every later draft was wrong. The likely cause: a random model's top logits are close, and the verify step's
kernels round differently from the decode step's.)
The output is therefore not the model's greedy text; correctness is tested elsewhere (tests/, bench/tiny_mtp.py
--device cuda). A run must emit exactly --new-tokens tokens per request. --batch B runs B requests of the same
prompt together, each drawing its own acceptances, so a round's sequences usually emit different counts (the
ragged MTP re-alignment).

    python3 bench/engine_mtp.py [--recipe nvfp4] [--ks 1,3,5 | 0] [--acceptance 0.6,0.75,0.9,1]
                                [--draft-heads lm_head,nvfp4] [--prompt-len 1024] [--new-tokens 256] [--batch 1]
                                [--profile-tokens 32]     # + one profiled generation per K (trace beside --out)
                                [--sync-audit]            # + the host syncs per decode step, by call site
    python3 bench/engine_mtp.py --tiny --device cpu --new-tokens 16     # CPU dry run (torch backend)

Records (--out, default bench/results/engine_mtp.json): {"kind": "engine_mtp", "recipe", "tp", "gpu",
"draft_head", "draft_tokens" (0 = plain decoding), "acceptance" (None at K = 0), "tok_s" (decode phase: tokens
after the first over the time after it), "tokens_per_round", "rounds", "ms_round", "accepted", "drafted",
"prompt_tokens", "new_tokens", "emitted" (the fewest of any request), "backend", "graphs", "draft_chain", "batch",
"round_graphs" (a greedy round's drafts and verify as one graph: ninfer_rt/graph_round.py; False at K = 0),
"temperature" (--temperature: 0 greedy, else every request sampled, seeded), "top_k", "top_p" (--top-k / --top-p
of the sampled requests; 0 / 1: off), "presence_penalty" (--presence-penalty), "topk_kernel" (NINFER_TOPK_KERNEL: the Triton top-k selection)};
K > 0 records also "graph_rounds" (engine steps a round graph served), "sampled_rounds" (of those, sampled round
graphs: ninfer_rt/graph_round_sampled.py, NINFER_SAMPLED_ROUNDS) and "tokens_digest" (a hash of the tokens:
runs of one rig and seed that compute alike emit alike, e.g. round graphs on and off).
--round-graphs 0,1 runs every K once per value (NINFER_ROUND_GRAPHS) on the one loaded model: a one-machine A/B.
With --batch B, tok_s counts every request's tokens and starts once each has its first. "ms_round" is the time per
engine step of that phase (a step runs one round per running request; since s39, before it the time per round,
which at batch 1 left out the last 1-token step), "rounds" and "tokens_per_round" count that phase's rounds. At
each K the first acceptance's record gains "syncs_per_step", "sync_sites" with --sync-audit (`sync_audit`) and
"profile" with --profile-tokens (`profile_run`) and "gaps" with --gap-tokens (bench/round_gaps.py: the GPU span of
each graph step and the gaps between them, from CUDA events, without the profiler's cost).
"""
from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import synth_artifact as synth
from bench_cli import ArgParser, positive_int
from ninfer_formats.atomic import write_json_atomic
from ninfer_formats.errors import NinferError

OUT = Path(__file__).resolve().parent / "results" / "engine_mtp.json"
DRAFT_HEAD_ENV = "NINFER_DRAFT_HEAD"       # ninfer_rt.draft_head.ENV (not imported: torch comes after the build)
ROUND_ENV = "NINFER_ROUND_GRAPHS"          # ninfer_rt.engine_layout.ROUND_GRAPHS_ENV


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _floats(text: str) -> tuple[float, ...]:
    try:
        v = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        v = ()
    if not v or any(not 0.0 <= a <= 1.0 for a in v):
        raise ValueError
    return v


def parse_args(argv=None):
    ap = ArgParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="nvfp4", help="synthetic artifact recipe (nvfp4, q6_k, iq3_s, bf16)")
    ap.add_argument("--ks", default="1,3,5", help="draft tokens per round to run (K = 0, plain, always runs; "
                                                  "--ks 0: plain decoding alone)")
    ap.add_argument("--acceptance", default="0.6,0.75,0.9,1", help="per-position acceptance rates in [0, 1]")
    ap.add_argument("--draft-heads", default="lm_head", help="NINFER_DRAFT_HEAD values, comma-separated")
    ap.add_argument("--prompt-len", type=positive_int, default=1024)
    ap.add_argument("--new-tokens", type=positive_int, default=256)
    ap.add_argument("--batch", type=positive_int, default=1, help="requests decoded together (same prompt)")
    ap.add_argument("--profile-tokens", type=int, default=0,
                    help="after each K's runs, profile one more generation of this many tokens at the first "
                         "acceptance (torch.profiler: tables to stderr, a Chrome trace beside --out)")
    ap.add_argument("--gap-tokens", type=int, default=0,
                    help="after each K's runs, one more generation of this many tokens at the first acceptance with "
                         "CUDA events around every graph step (bench/round_gaps.py; CUDA only)")
    ap.add_argument("--sync-audit", action="store_true",
                    help="after each K's runs, one more generation under torch.cuda.set_sync_debug_mode: the host "
                         "syncs per decode step and where they come from (syncs_per_step, sync_sites)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sample every request at this temperature (seeded; default 0: greedy). Sampled drafts take "
                         "the distributions and the rejection-sampling verdict; the accepted count stays rigged")
    ap.add_argument("--top-k", type=int, default=0, help="with --temperature: top_k of every request (0: off)")
    ap.add_argument("--top-p", type=float, default=1.0, help="with --temperature: top_p of every request (1: off)")
    ap.add_argument("--presence-penalty", type=float, default=0.0,
                    help="with --temperature: presence_penalty of every request (NInfer's presets: 1.0 / 1.5)")
    ap.add_argument("--round-graphs", default="",
                    help="NINFER_ROUND_GRAPHS values (0, 1), comma-separated: every K runs once per value "
                         "(default: the environment's, else the runtime's default)")
    synth.add_engine_args(ap, OUT)
    args = ap.parse_args(argv)
    args.round_graphs = tuple(v.strip() for v in args.round_graphs.split(",") if v.strip())
    if any(v not in ("0", "1") for v in args.round_graphs):
        ap.error(f"--round-graphs: expected comma-separated 0 / 1 values, got {','.join(args.round_graphs)!r}")
    try:
        ks = tuple(sorted({int(k) for k in args.ks.split(",") if k.strip()}))
        assert ks == (0,) or (ks and all(1 <= k <= 7 for k in ks))
        args.ks = () if ks == (0,) else ks
    except (ValueError, AssertionError):
        ap.error(f"--ks: expected 0 (plain decoding alone) or comma-separated integers in 1..7, got {args.ks!r}")
    try:
        args.acceptance = _floats(args.acceptance)
    except ValueError:
        ap.error(f"--acceptance: expected comma-separated numbers in [0, 1], got {args.acceptance!r}")
    if not 0 <= args.temperature <= 10:
        ap.error(f"--temperature: expected a number in [0, 10], got {args.temperature}")
    if args.top_k < 0 or not 0 < args.top_p <= 1:
        ap.error(f"--top-k / --top-p: expected top_k >= 0 and top_p in (0, 1], got {args.top_k}, {args.top_p}")
    if (args.top_k or args.top_p < 1 or args.presence_penalty) and not args.temperature:
        ap.error("--top-k / --top-p / --presence-penalty: they apply to sampled requests; give --temperature too")
    if not -2 <= args.presence_penalty <= 2:
        ap.error(f"--presence-penalty: expected a number in [-2, 2], got {args.presence_penalty}")
    if args.gap_tokens < 0:
        ap.error(f"--gap-tokens: expected 0 (off) or a number of tokens, got {args.gap_tokens}")
    if args.profile_tokens < 0:
        ap.error(f"--profile-tokens: expected 0 (off) or a number of tokens, got {args.profile_tokens}")
    args.draft_heads = tuple(h.strip() for h in args.draft_heads.split(",") if h.strip())
    if not args.draft_heads:
        ap.error("--draft-heads: expected at least one value")
    return args


def make_rigged(Engine):
    """Verdicts rigged to a per-position acceptance `rate`: the first n drafts are accepted, n drawn per round
    (draft j with probability `rate` while drafts 1..j-1 were), after the real decision's kernels and read-back
    (`verify_rows` of the module that defines `_decide_verdicts`, so an earlier runtime from bench/ab_tree.sh
    keeps its own; a sampled round graph's verdicts, `_decided`, are rigged alike). The drafts are the real ones,
    and the bonus token is the real decision's. So the state stays what the Engine built from the tokens it was
    given, and every rollback, re-alignment and draft step is the real one."""
    mod = sys.modules[Engine._decide_verdicts.__module__]      # where the verdicts call it (engine_decide.py)
    real = mod.verify_rows

    class RiggedEngine(Engine):
        rate: float = 1.0
        rng = random.Random(0)

        def _decide_verdicts(self, dec, drafts, pre, out):
            for (_, k), d in zip(dec, getattr(self, "_decided", None) or ()):     # a sampled round graph's verdicts
                d[0] = self._rig(k)
            mod.verify_rows = self._rigged_rows
            try:
                return super()._decide_verdicts(dec, drafts, pre, out)
            finally:
                mod.verify_rows = real

        def _rig(self, k: int) -> int:
            n = 0
            while n < k and self.rng.random() < self.rate:
                n += 1
            return n

        def _rigged_rows(self, rows) -> list[list[int]]:
            decided = real(rows)
            for r, d in zip(rows, decided):
                if r.drafts:
                    d[0] = self._rig(len(r.drafts))
            return decided
    return RiggedEngine


@dataclass
class Run:
    """One `generate`: each request's tokens, and the decode phase's tokens, seconds, engine steps and MTP counts
    (rounds / accepted / drafted; zeros without MTP). The decode phase runs from the step where every request
    has its first token to the last token."""
    tokens: list[list[int]]
    decode_tokens: int
    secs: float
    steps: int
    spec: dict


def request_params(eng, new_tokens: int, b: int):
    """Request b's parameters: greedy, or sampled at the engine's `temperature` (--temperature) with seed b."""
    from ninfer_rt.sampling import SamplingParams
    t = getattr(eng, "temperature", 0.0)
    trunc = {"top_k": eng.top_k, "top_p": eng.top_p, "presence_penalty": eng.presence_penalty} \
        if t and hasattr(eng, "top_k") else {}
    return SamplingParams(temperature=t, seed=b if t else None, max_tokens=new_tokens, ignore_eos=True, **trunc)


def generate(eng, prompt: list[int], new_tokens: int, batch: int = 1) -> Run:
    for b in range(batch):
        eng.add_request(f"r{b}", prompt, request_params(eng, new_tokens, b))
    out: dict[str, list[int]] = {f"r{b}": [] for b in range(batch)}
    t_first, before, spec0, steps = None, 0, _spec(eng), 0
    while eng.has_work():
        for o in eng.step():
            out[o.req_id] += o.new_token_ids
        steps += t_first is not None
        if t_first is None and all(out.values()):
            t_first, before, spec0 = time.perf_counter(), sum(map(len, out.values())), _spec(eng)
    if eng.device.type == "cuda":       # a decode step leaves its alignment running (Engine._step_sync)
        import torch
        torch.cuda.synchronize(eng.device)
    got = list(out.values())
    return Run(got, sum(map(len, got)) - before, time.perf_counter() - (t_first or time.perf_counter()), steps,
               _delta(_spec(eng), spec0))


def _spec(eng) -> dict:
    st = eng.stats.spec
    return st.to_dict() if st is not None else {"rounds": 0, "accepted": 0, "drafted": 0}


def _engine(loaded, args, k: int):
    import torch

    from ninfer_rt.backends import get_ops
    from ninfer_rt.engine import Engine
    from ninfer_rt.speculative import SpecConfig
    cls = make_rigged(Engine) if k else Engine
    eng = cls(loaded, get_ops(args.backend), spec=SpecConfig(num_draft_tokens=k) if k else None,
              max_batch=args.batch, max_model_len=args.prompt_len + args.new_tokens + 16,
              graphs="off" if args.eager else "auto")
    eng.temperature, eng.top_k, eng.top_p = args.temperature, args.top_k, args.top_p
    eng.presence_penalty = args.presence_penalty
    torch.manual_seed(args.seed)
    return eng


def measure_head(loaded, args, head: str, base: dict, save=lambda recs: None) -> list[dict]:
    """K = 0 (the plain rate), then every K at every acceptance, with one draft head. Each engine
    lives inside one call, so its model's memory is free again before the next one is built (`_collect`).
    `save(records so far)` runs after each K's timed runs, ahead of its (slow) audit and profile."""
    os.environ[DRAFT_HEAD_ENV] = head
    prompt = random.Random(args.seed).choices(range(min(loaded.config.vocab_size, 4096)), k=args.prompt_len)
    run = _plain(loaded, args, prompt)
    _collect()
    plain = {**base, "draft_head": head, "round_graphs": False, "draft_tokens": 0, "acceptance": None, "rounds": None,
             "tokens_per_round": 1.0, "tok_s": run.decode_tokens / run.secs,
             "ms_round": run.secs / max(1, run.steps) * 1e3, "accepted": 0, "drafted": 0,
             "emitted": min(map(len, run.tokens))}
    log(f"{head}: K=0 {plain['tok_s']:.1f} tok/s")
    out = [plain]
    for k in args.ks:
        for rg in args.round_graphs or (None,):
            with _round_env(rg):
                b = {**base, "draft_head": head, "round_graphs": base["graphs"] and round_graphs_on()}
                out += _rounds(loaded, args, k, prompt, b, lambda recs: save(out + recs))
            _collect()
    return out


@contextlib.contextmanager
def _round_env(value: str | None):
    """NINFER_ROUND_GRAPHS=value for one engine (None: as it is)."""
    before = os.environ.get(ROUND_ENV)
    if value is not None:
        os.environ[ROUND_ENV] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(ROUND_ENV, None)
        else:
            os.environ[ROUND_ENV] = before


def round_graphs_on() -> bool:
    """Whether an engine built now captures round graphs (False for a runtime without them: bench/ab_tree.sh)."""
    try:
        from ninfer_rt.engine_layout import round_graph_drafts
    except ImportError:
        return False
    return round_graph_drafts(1) == 1


def _plain(loaded, args, prompt) -> Run:
    eng = _engine(loaded, args, 0)
    generate(eng, prompt, min(8, args.new_tokens), args.batch)            # warm-up: compiles, tunes
    try:
        return generate(eng, prompt, args.new_tokens, args.batch)
    finally:
        eng.shutdown()


def _rounds(loaded, args, k: int, prompt, base: dict, save=lambda recs: None) -> list[dict]:
    eng = _engine(loaded, args, k)
    generate(eng, prompt, min(8, args.new_tokens), args.batch)            # warm-up at this K
    out = []
    for a in args.acceptance:
        eng.rate, eng.rng = a, random.Random(args.seed)
        graph_rounds, sampled_rounds = _graph_rounds(eng), _graph_rounds(eng, "sampled_rounds")
        run = generate(eng, prompt, args.new_tokens, args.batch)
        st = run.spec
        rec = {**base, "draft_tokens": k, "acceptance": a, "rounds": st["rounds"],
               "accepted": st["accepted"], "drafted": st["drafted"],
               "tokens_per_round": 1 + st["accepted"] / st["rounds"] if st["rounds"] else 1.0,
               "tok_s": run.decode_tokens / run.secs, "ms_round": run.secs / max(1, run.steps) * 1e3,
               "emitted": min(map(len, run.tokens)), "graph_rounds": _graph_rounds(eng) - graph_rounds,
               "sampled_rounds": _graph_rounds(eng, "sampled_rounds") - sampled_rounds,
               "tokens_digest": digest(run.tokens)}
        log(f"{rec['draft_head']}: K={k} a={a:g} {rec['tok_s']:.1f} tok/s, {rec['tokens_per_round']:.2f} "
            f"tokens/round, {rec['ms_round']:.2f} ms/round, {rec['graph_rounds']} round graphs, "
            f"tokens {rec['tokens_digest']}")
        out.append(rec)
    save(out)
    if args.sync_audit:
        eng.rate, eng.rng = args.acceptance[0], random.Random(args.seed)
        out[0].update(sync_audit(eng, prompt, args.new_tokens, args.batch))
        log(f"{base['draft_head']}: K={k} a={args.acceptance[0]:g} sync audit: {out[0]['syncs_per_step']} per "
            f"decode step, {out[0]['sync_sites']}")
    if args.gap_tokens and eng.device.type == "cuda" and eng.graphs is not None:
        import round_gaps
        eng.rate, eng.rng = args.acceptance[0], random.Random(args.seed)
        out[0]["gaps"] = round_gaps.gap_run(eng, generate, prompt, args.gap_tokens, args.batch)
        log(f"{base['draft_head']}: K={k} a={args.acceptance[0]:g} gaps: {json.dumps(out[0]['gaps'])}")
    if args.profile_tokens:
        eng.rate, eng.rng = args.acceptance[0], random.Random(args.seed)
        out[0]["profile"] = profile_run(eng, prompt, args, f"{base['draft_head']}: K={k} a={args.acceptance[0]:g}",
                                        trace_path(args, base["draft_head"], k))
    eng.shutdown()
    return out


def _graph_rounds(eng, field: str = "rounds") -> int:
    """Engine steps served by a round graph so far ("sampled_rounds": by a sampled one; 0 without them)."""
    return getattr(eng.graphs.stats, field, 0) if eng.graphs is not None else 0


def digest(tokens: list[list[int]]) -> str:
    """A short hash of every request's tokens: runs of one rig and seed that compute alike emit alike."""
    return hashlib.sha1(json.dumps(tokens).encode()).hexdigest()[:12]


def trace_path(args, head: str, k: int) -> str:
    stem = str(Path(args.out).with_suffix(""))
    return f"{stem}_trace_{head.replace(':', '-')}_K{k}.json.gz"


def profile_run(eng, prompt, args, label: str, path: str) -> dict:
    """One more generation of --profile-tokens under torch.profiler, its prompt step left out: where a round's wall
    time goes besides the GPU's kernels (host work between the steps, syncs, read-backs). Tables to the log, the
    Chrome trace to `path`. -> {"rounds", "ms_round_wall", "busy_us_round" (the GPU's kernels, overlaps counted
    once), "idle_us_round" (no kernel running), "excl_us_by_group", "idle_top"}; the profiler's own host work
    lengthens the idle gaps, so compare them with the unprofiled ms_round."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    import decode_measure as M
    cuda = torch.cuda.is_available()
    got = _first_token(eng, prompt, args.profile_tokens, args.batch)
    rounds0 = eng.stats.spec.rounds
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        t = time.perf_counter()
        while eng.has_work():
            got += [tok for o in eng.step() for tok in o.new_token_ids]
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t
    rounds = max(1, round((eng.stats.spec.rounds - rounds0) / args.batch))     # steps: a round per request each
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    excl, idle = M._exclusive(events, rounds) if events else ({}, 0.0)
    groups: dict[str, float] = {}
    for name, us in excl.items():
        groups[M._group(name)] = round(groups.get(M._group(name), 0.0) + us, 1)
    out = {"rounds": rounds, "ms_round_wall": round(wall / rounds * 1e3, 3),
           "busy_us_round": round(sum(excl.values()), 1), "idle_us_round": round(idle, 1),
           "excl_us_by_group": groups, "idle_top": M.idle_by_transition(events, rounds, 8) if events else []}
    log(f"profile {label}: {len(got)} tokens, {rounds} rounds after the prompt: {out['ms_round_wall']:.3f} ms per "
        f"round, GPU busy {out['busy_us_round']:.0f} us and idle {out['idle_us_round']:.0f} us per round")
    log(f"profile {label}: {json.dumps(out)}")
    log(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    prof.export_chrome_trace(path)
    log(f"trace: {path}")
    return out


def _first_token(eng, prompt, new_tokens: int, batch: int = 1) -> list[int]:
    """Add `batch` requests (`request_params`) and step until each has its first token (the prompt's steps: eager, they
    sync). -> the tokens so far."""
    for b in range(batch):
        eng.add_request(f"measured{b}", prompt, request_params(eng, new_tokens, b))
    got: list[int] = []
    started: set[str] = set()
    while eng.has_work() and len(started) < batch:
        for o in eng.step():
            got += o.new_token_ids
            if o.new_token_ids:
                started.add(o.req_id)
    return got


def sync_audit(eng, prompt, new_tokens: int, batch: int = 1) -> dict:
    """One generation's decode steps (after the first token) with torch's sync debug mode on: each host sync it
    flags (read-backs, pageable host->device copies; not Event.synchronize) is a warning, and explicit
    torch.cuda.synchronize calls are counted too. -> {"syncs_per_step", "sync_sites": {"file:line": count}}."""
    import warnings

    import torch
    if not torch.cuda.is_available():
        return {"syncs_per_step": None, "sync_sites": {}}
    _first_token(eng, prompt, new_tokens, batch)
    sites: dict[str, int] = {}
    real, steps = torch.cuda.synchronize, 0

    def explicit(*a, **kw):           # the debug mode does not flag torch.cuda.synchronize itself
        f = sys._getframe(1)
        key = f"synchronize@{Path(f.f_code.co_filename).name}:{f.f_lineno}"
        sites[key] = sites.get(key, 0) + 1
        return real(*a, **kw)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        torch.cuda.synchronize = explicit
        try:
            while eng.has_work():
                eng.step()
                steps += 1
        finally:
            torch.cuda.set_sync_debug_mode("default")
            torch.cuda.synchronize = real
    for w in caught:
        if "synchroniz" in str(w.message):
            key = f"{Path(w.filename).name}:{w.lineno}"
            sites[key] = sites.get(key, 0) + 1
    return {"syncs_per_step": round(sum(sites.values()) / max(1, steps), 2), "sync_sites": sites}


def _collect() -> None:
    """Give the last engine's memory back (its model's fused weights, graphs) before the next one is built."""
    import torch
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in ("rounds", "accepted", "drafted")}


def _init_profiler() -> None:
    """An empty CUDA profile before any graph is captured: Kineto set up after a capture can hang the first
    profile of a graph replay (pytorch/pytorch#75504, #135003; both s41 and s42 profiles ran past 300 s)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]):
        pass


def measure(args, path: str) -> list[dict]:
    import torch

    import bench_device as D
    from ninfer_rt.loader import load
    from ninfer_rt.sampling_rows import topk_kernel
    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    args.backend = args.backend or ("triton" if args.device == "cuda" else "torch")
    if args.profile_tokens and device.type == "cuda":
        _init_profiler()
    loaded = load(path, device=device, dtype=dtype)
    base = {"kind": "engine_mtp", "recipe": args.recipe, "tp": 1, "gpu": D.device_name(device),
            "backend": args.backend, "graphs": args.device == "cuda" and not args.eager,
            "prompt_tokens": args.prompt_len, "new_tokens": args.new_tokens,
            "draft_chain": os.environ.get("NINFER_DRAFT_CHAIN", "1") == "1", "batch": args.batch,
            "temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p,
            "presence_penalty": args.presence_penalty,
            "topk_kernel": topk_kernel()}
    records, before = [], os.environ.get(DRAFT_HEAD_ENV)
    try:
        for head in args.draft_heads:
            # a call that runs out of time keeps every K it timed
            done = list(records)
            records += measure_head(loaded, args, head, base, lambda recs: write_json_atomic(args.out, done + recs))
            write_json_atomic(args.out, records)
    finally:
        if before is None:
            os.environ.pop(DRAFT_HEAD_ENV, None)
        else:
            os.environ[DRAFT_HEAD_ENV] = before
        loaded.close()
    return records


def _check_heads(heads: tuple[str, ...]) -> None:
    """Each value a draft head the runtime knows; an earlier runtime (an A/B tree from bench/ab_tree.sh) without
    ninfer_rt.draft_head runs the lm_head only."""
    try:
        from ninfer_rt.draft_head import DraftHeadSpec
    except ImportError:
        if set(heads) != {"lm_head"}:
            raise NinferError("--draft-heads: this ninfer_rt has no draft heads but the lm_head") from None
        return
    for head in heads:
        DraftHeadSpec.parse(head, "--draft-heads")


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        _check_heads(args.draft_heads)
        records = measure(args, synth.engine_artifact(args, log))
        write_json_atomic(args.out, records)
    except (NinferError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{'draft head':<14} {'K':>2} {'accept':>6} {'tok/s':>8} {'tok/round':>9} {'ms/round':>9} emitted")
    for r in records:
        a = "-" if r["acceptance"] is None else f"{r['acceptance']:g}"
        print(f"{r['draft_head']:<14} {r['draft_tokens']:>2} {a:>6} {r['tok_s']:>8.1f} {r['tokens_per_round']:>9.2f} "
              f"{r['ms_round']:>9.2f} {r['emitted']:>7}")
    log(f"wrote {args.out}")
    short = [r for r in records if r["emitted"] != args.new_tokens]
    if short:
        print(f"error: {short[0]['draft_head']} K={short[0]['draft_tokens']}: emitted {short[0]['emitted']} tokens, "
              f"not --new-tokens {args.new_tokens}", file=sys.stderr)
    return 1 if short else 0


if __name__ == "__main__":
    sys.exit(main())
