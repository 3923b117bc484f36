"""`convert()`: HF Qwen3.8 checkpoint -> TP-sharded, checksummed `.ninfer` rank files + report + model card.

Order of work: open and validate the whole source (headers only), plan every tensor (format, TP cut),
prepare the output folder (refuse / resume / start over), create all rank writers, run the tasks in worker
processes (memory-bounded scheduling), finalize the TP set, then publish report.json and README.md.
Resumable: finished tensors are journaled by the writers and skipped by a rerun with the same arguments;
a source whose files were only touched (new mtimes) still resumes once its finished tensors re-hash as recorded.
"""
from __future__ import annotations

import json
import multiprocessing
import os
import signal
import sys
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path

import xxhash

from ninfer_formats.container import RankWriter, finalize_set, open_artifact, rank_file_name
from ninfer_formats.errors import NinferError, SourceError
from ninfer_formats.proc_signals import parent_signals_blocked

from . import out_dir
from .hf_source import open_source
from .model_card import render_card
from .pack_plan import STEM, PackPlan, Task, make_plan
from .pack_worker import init_worker, run_task, source_digest
from .recipes import DEFAULT, load_recipe
from .report import build_report

MEM_SLACK = 1 << 30            # bytes of encoded shards allowed in flight beside the largest task
KILL_HOOK = "NINFER_PACK_TEST_KILL_AFTER"   # tests: SIGKILL this process after N finished tasks


class PackError(NinferError):
    """The conversion itself failed (a worker died); the output folder stays resumable."""


@dataclass(frozen=True)
class ConvertResult:
    out_dir: Path
    files: list[Path]
    report: dict


def default_jobs() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _state(plan: PackPlan) -> dict:
    """Resume state: `args` (recipe, TP, cuts) and the source (config, headers, sizes) make the fingerprint;
    mtimes are kept beside it, so a touched source resumes after its done tensors are re-checked."""
    args = xxhash.xxh3_128(json.dumps(plan.recipe.describe(), sort_keys=True).encode())
    for j in plan.jobs:
        args.update(f"{j.name}:{j.fmt}:{j.split.rank_shape}:{j.split.ranges}\n".encode())
    fp = xxhash.xxh3_128(f"{plan.source.fingerprint}:{args.hexdigest()}".encode())
    stats = {f: os.stat(f) for f in sorted({j.src.file for j in plan.jobs})}
    files = [rank_file_name(STEM, plan.tp, r) for r in range(plan.tp)]
    return {"fingerprint": fp.hexdigest(), "args": args.hexdigest(), "files": files,
            "source_files": {os.path.basename(f): [st.st_size, st.st_mtime_ns] for f, st in stats.items()},
            "summary": f"recipe {plan.recipe.name}, tp {plan.tp}, source {plan.source.label}"}


def _check_source(plan: PackPlan, out: Path, old: dict | None, state: dict) -> None:
    """Resuming after the source files were touched: their already converted tensors must hash as recorded
    (same bytes: resume; otherwise refuse, naming the file). Then the new mtimes are recorded."""
    was = (old or {}).get("source_files", {})
    touched = {n for n, st in state["source_files"].items() if was.get(n) != st}
    if not touched:
        return
    reports = out_dir.load_reports(out)
    for j in plan.jobs:
        if os.path.basename(j.src.file) not in touched or j.name not in reports:
            continue
        if reports[j.name].get("source_xxh3") != source_digest(j.src):
            raise SourceError(f"{j.src.file}: changed since the unfinished conversion in {out} began "
                              f"(tensor {j.src.hf_name} differs); add --force to start over")
    out_dir.write_state(out, state)


class _Progress:
    def __init__(self, tasks: list[Task], enabled: bool):
        from tqdm import tqdm
        kw = dict(file=sys.stderr, disable=not enabled, dynamic_ncols=True)
        self.bytes = tqdm(total=sum(t.source_bytes for t in tasks), unit="B", unit_scale=True,
                          unit_divisor=1024, desc="weights", position=0, **kw)
        self.tensors = tqdm(total=sum(1 for t in tasks for todo in t.todo if todo), unit="tensor",
                            desc="tensors", position=1, **kw)

    def done(self, task: Task, n: int) -> None:
        self.bytes.update(task.source_bytes)
        self.tensors.update(n)

    def close(self) -> None:
        self.tensors.close()
        self.bytes.close()


def _kill_hook(finished: int) -> None:
    limit = os.environ.get(KILL_HOOK)
    if limit and finished >= int(limit):
        os.kill(os.getpid(), signal.SIGKILL)


def _run_pool(tasks: list[Task], writers, jobs: int, on_done) -> None:
    """Run tasks in `jobs` spawned workers; encoded bytes in flight stay under largest task + MEM_SLACK."""
    budget = max(t.cost for t in tasks) + MEM_SLACK
    pending, inflight, used = list(tasks), {}, 0
    ex = ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn"),
                             initializer=init_worker, initargs=(writers, os.getpid()))
    try:
        while pending or inflight:
            while pending and len(inflight) < jobs:
                k = next((i for i, t in enumerate(pending) if not inflight or used + t.cost <= budget), None)
                if k is None:
                    break
                t = pending.pop(k)
                with parent_signals_blocked((signal.SIGINT,)):   # a worker may start here; see proc_signals
                    inflight[ex.submit(run_task, t)] = t
                used += t.cost
            finished, _ = wait(inflight, return_when=FIRST_COMPLETED)
            for f in finished:
                t = inflight.pop(f)
                used -= t.cost
                on_done(t, f.result())
    except BrokenProcessPool:
        raise PackError("a worker process died (out of memory? try a smaller -j); "
                        "rerun the same command to resume") from None
    except BaseException:
        _end_workers(ex)     # Ctrl-C or an error: the workers ignore SIGINT, so do not wait for their tasks
        raise
    finally:
        ex.shutdown(wait=True, cancel_futures=True)


def _end_workers(ex: ProcessPoolExecutor) -> None:
    """Terminate the pool's workers now (a half-written tensor has no report line, so resume redoes it)."""
    procs = list((getattr(ex, "_processes", None) or {}).values())
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(5)


def _execute(plan: PackPlan, out: Path, jobs: int, progress: bool) -> None:
    writers = [RankWriter(out / rank_file_name(STEM, plan.tp, r), plan.rank_plan(r)) for r in range(plan.tp)]
    try:
        reports = out_dir.load_reports(out)
        # a tensor whose report line was lost (killed in between) is converted again
        done = [{n for n in w.done() if n in reports} for w in writers]
        tasks = plan.tasks(done)
        bar, count = _Progress(tasks, progress), [0]

        def on_done(task: Task, entries: list[dict]) -> None:
            out_dir.append_reports(out, entries)
            bar.done(task, len(entries))
            count[0] += 1
            _kill_hook(count[0])

        try:
            if jobs <= 1 or len(tasks) <= 1:
                for t in tasks:
                    on_done(t, run_task(t, writers))
            else:
                _run_pool(tasks, writers, jobs, on_done)
        finally:
            bar.close()
        finalize_set(writers)
    finally:
        for w in writers:
            w.close()


def _publish(plan: PackPlan, out: Path, base_model: str | None) -> ConvertResult:
    files = [out / rank_file_name(STEM, plan.tp, r) for r in range(plan.tp)]
    with open_artifact(files[0]) as a:
        artifact_id = a.artifact_id
    report = build_report(plan, out_dir.load_reports(out), files, artifact_id)
    card = render_card(plan, report, base_model)
    out_dir.publish(out, {"report.json": (json.dumps(report, indent=1) + "\n").encode(),
                          "README.md": card.encode()})
    return ConvertResult(out, files, report)


def convert(source: str, out: str | os.PathLike, *, recipe: str = DEFAULT, overrides=(), tp: int = 1,
            jobs: int | None = None, vision: bool = True, mtp: bool = True, force: bool = False,
            progress: bool = True, base_model: str | None = None) -> ConvertResult:
    """Pack `source` (folder or Hub id) into `out`; see the module doc. Raises NinferError subclasses."""
    src = open_source(str(source), vision=vision, mtp=mtp)
    plan = make_plan(src, load_recipe(recipe, tuple(overrides)), tp)
    out = Path(out)
    if out.resolve() == src.root.resolve():
        # the source folder holds files named like ours (README.md) that are not ours to replace
        raise SourceError(f"{out}: is the source folder; write the artifact to another folder")
    state, old = _state(plan), out_dir.read_state(out)
    mode = out_dir.prepare(out, state, force, STEM)
    if mode != "fresh":
        _check_source(plan, out, old, state)
    if mode != "publish":
        _execute(plan, out, jobs or default_jobs(), progress)
    return _publish(plan, out, base_model)
