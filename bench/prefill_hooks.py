"""The measured side of bench/prefill_profile.py: load the artifact into a Model, run prefills, and mark
layers and ops so the profiler's kernels can be attributed (bench/prefill_breakdown.py does the sums).

Instrumentation wraps, for the duration of one run only: `model.ops` (a proxy that puts each backend call in
an "§op:<method>" range), `model._embed` / `model._output` and every block's mixer (section boundaries
"embed", "layer:<i>:<gdn|attn>", "head"). A layer's section runs from its mixer call to the next section,
so it holds the layer's mixer, both residual norms and the MLP; the second norm is the next layer's input norm,
and with it that layer's b/a gates when it is a GDN layer (`Ops.norm_ba_gates`). Nothing in ninfer_rt is modified.
"""
from __future__ import annotations

import math
import time
from contextlib import contextmanager

import bench_device as D
import torch

SEC, OP = "§sec:", "§op:"
PAGE = 16


def linear_params(model) -> dict:
    """Linear weight parameters (N * K) of one decoder layer of each type: {"gdn": .., "attn": ..}."""
    out = {}
    for blk in model.blocks:
        ws = D.qweights([blk.mixer, blk.mlp])
        out.setdefault("attn" if blk.full else "gdn", sum(w.shape[0] * w.shape[1] for w in ws))
    return out


class Hooks:
    """Section boundaries and op ranges. mode "off": nothing; "marks": a timestamp (CUDA event) at every
    section boundary; "profile": record_function ranges, each closed after a device sync."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.mode, self.marks, self._sec = "off", [], None

    def _stamp(self):
        if self.device.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def begin(self, label: str) -> None:
        if self.mode == "marks":
            self.marks.append((label, self._stamp()))
        elif self.mode == "profile":
            self._close()
            self._sec = torch.autograd.profiler.record_function(SEC + label)
            self._sec.__enter__()

    def end(self) -> None:
        if self.mode == "marks":
            self.begin("end")
        else:
            self._close()

    def _close(self) -> None:
        if self._sec is not None:
            D.sync(self.device)
            self._sec.__exit__(None, None, None)
            self._sec = None

    @contextmanager
    def op(self, name: str):
        if self.mode != "profile":
            yield
            return
        rf = torch.autograd.profiler.record_function(OP + name)
        rf.__enter__()
        try:
            yield
        finally:
            D.sync(self.device)
            rf.__exit__(None, None, None)

    def resolved_marks(self) -> list[tuple[str, float]]:
        """[(label, seconds since the first mark)] (waits for the events)."""
        if not self.marks:
            return []
        D.sync(self.device)
        first = self.marks[0][1]
        if self.device.type == "cuda":
            return [(lab, first.elapsed_time(ev) / 1e3) for lab, ev in self.marks]
        return [(lab, t - first) for lab, t in self.marks]


class _OpsProxy:
    def __init__(self, ops, hooks: Hooks):
        self._ops, self._hooks, self._fns = ops, hooks, {}

    def __getattr__(self, name):
        fn = getattr(self._ops, name)
        if name.startswith("_") or not callable(fn):
            return fn
        if name not in self._fns:
            hooks = self._hooks

            def call(*a, **k):
                with hooks.op(name):
                    return fn(*a, **k)
            self._fns[name] = call
        return self._fns[name]


def _section(label: str, fn, hooks: Hooks):
    def call(*a, **k):
        hooks.begin(label)
        return fn(*a, **k)
    return call


@contextmanager
def instrumented(model, hooks: Hooks):
    ops, mixers = model.ops, [blk.mixer for blk in model.blocks]
    model.ops = _OpsProxy(ops, hooks)
    model._embed = _section("embed", model._embed, hooks)
    model._output = _section("head", model._output, hooks)
    for i, blk in enumerate(model.blocks):
        blk.mixer = _section(f"layer:{i}:{'attn' if blk.full else 'gdn'}", blk.mixer, hooks)
    try:
        yield
    finally:
        model.ops = ops
        del model._embed, model._output          # back to the class methods
        for blk, m in zip(model.blocks, mixers):
            blk.mixer = m


class PrefillRun:
    """The loaded model and the prefill loops (one random prompt per run, the state freed after)."""

    def __init__(self, path: str, device: str, dtype, backend: str, tokens: int, chunk: int):
        from ninfer_rt.backends import get_ops
        from ninfer_rt.loader import load
        from ninfer_rt.model import Model
        from ninfer_rt.state import CacheConfig
        self.device = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
        self.tokens, self.chunk, self.gen = tokens, chunk, torch.Generator().manual_seed(0)
        t = time.perf_counter()
        loaded = load(path, verify=True, device=self.device, dtype=dtype)
        cache = CacheConfig(num_pages=math.ceil(tokens / PAGE) + 8, page_size=PAGE, max_seqs=2)
        self.ops = get_ops(backend)
        self.model = Model(loaded.config, loaded.weights, self.ops, cache=cache, dtype=dtype, consume_weights=True)
        loaded.close()
        D.sync(self.device)
        self.load_s = time.perf_counter() - t
        self.hooks = Hooks(self.device)

    def prefill(self) -> None:
        from ninfer_rt.model import SeqInput
        ids = torch.randint(0, self.model.cfg.vocab_size, (self.tokens,), generator=self.gen)
        st = self.model.new_state()
        try:
            for a in range(0, self.tokens, self.chunk):
                b = min(self.tokens, a + self.chunk)
                self.hooks.begin("setup")
                self.model.forward([SeqInput(ids[a:b], st, logits="last" if b == self.tokens else "none")])
            self.hooks.end()
        finally:
            st.free()

    def timed(self) -> float:
        D.sync(self.device)
        t = time.perf_counter()
        self.prefill()
        D.sync(self.device)
        return time.perf_counter() - t

    def sections(self) -> list[tuple[str, float]]:
        self.hooks.mode, self.hooks.marks = "marks", []
        try:
            with instrumented(self.model, self.hooks):
                self.prefill()
            return self.hooks.resolved_marks()
        finally:
            self.hooks.mode = "off"

    def profile(self):
        """-> (kernels, sections, op ranges) of one profiled prefill (see prefill_breakdown)."""
        from torch.profiler import ProfilerActivity, profile
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        self.hooks.mode = "profile"
        try:
            with instrumented(self.model, self.hooks), profile(activities=acts) as prof:
                self.prefill()
                D.sync(self.device)
        finally:
            self.hooks.mode = "off"
        return events(prof, self.device.type == "cuda")


def _top_level_aten(e) -> bool:
    p = e.cpu_parent
    while p is not None:
        if p.name.startswith("aten::"):
            return False
        p = p.cpu_parent
    return e.name.startswith("aten::")


def events(prof, cuda: bool):
    """Kernels (CUDA: device events with the host time of their launch when the profiler links it; CPU: the
    top-level aten ops), section ranges and op ranges, in us."""
    from torch.autograd import DeviceType
    secs, ops, kernels, launches = [], [], [], {}
    evs = prof.events()
    for e in evs:
        marked = e.name.startswith(SEC) or e.name.startswith(OP)
        if e.device_type == DeviceType.CPU and marked:
            r = e.time_range
            (secs if e.name.startswith(SEC) else ops).append((e.name.split(":", 1)[1], r.start, r.end))
        elif e.device_type == DeviceType.CPU:
            if e.id:       # the launch (runtime call or aten op) a kernel's linked_correlation_id names
                launches.setdefault(e.id, e.time_range.start)
            if not cuda and _top_level_aten(e):
                kernels.append((e.name, e.time_range.start, e.time_range.elapsed_us(), None))
    if cuda:
        for e in evs:
            if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False) \
                    and not (e.name.startswith(SEC) or e.name.startswith(OP)):
                link = getattr(e, "linked_correlation_id", 0)
                kernels.append((e.name, e.time_range.start, e.time_range.elapsed_us(), launches.get(link)))
    return kernels, secs, ops
