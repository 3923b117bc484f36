"""The engine the CLI and the server drive: requests in, tokens out, one step's tokens per `step()`.

    eng = Engine(loaded, ops, tp, spec=SpecConfig(num_draft_tokens=3), max_batch=8)
    eng.add_request("r1", prompt_ids, SamplingParams(temperature=0, max_tokens=64))
    while eng.has_work():
        for o in eng.step(): ...          # StepOutput(req_id, new_token_ids, finished, finish_reason, text,
                                          #            drafted, accepted,  -- MTP counts of this step
                                          #            logprobs)           -- with SamplingParams(logprobs=k)

Scheduling: FIFO admission while a GDN slot is free and the KV pool can hold the request's whole reservation
(prompt + max_tokens, capped at the context), so a running sequence never waits for pages; every step runs
prefill chunks (a shared token budget, `prefill_chunk`) and one decode or speculative round for ALL
sequences whose prompt is done, batched into one target forward. Rank 0 decides; with TP > 1 the plan, the
drafts and the verdicts go to the followers (`Follower`, engine_follower.py) so every rank makes identical calls.
The leader's decisions (drafts, verdicts, the emission of tokens up to a stop) are `engine_decide.Decisions`.

Images (`vision=VisionRuntime`, ninfer_rt/vision): the request thread makes a `VisionRequest` (CPU:
decode, resize, placeholder expansion), `add_request(..., vision=vr)` runs the tower on this thread and the
sequence then carries its MRoPE positions and spliced embeddings into every forward (prefill, decode,
verify, MTP). Only rank 0 holds the tower; followers receive the embeddings with the admitting step.

CUDA graphs (`graphs=`, default "auto"): on CUDA with the triton backend the decode, verify and draft steps
replay graphs captured at construction (`graph_config`); "eager" runs the same static-buffer steps without
capture (CLI `--eager`), "off" the plain model. On CPU there are none, and a step is one forward as before.

Run-ahead (`async_scheduling=`, default on CUDA; engine_ahead.py): while every running sequence is a plain
decode row that the leader alone decides (TP1, no MTP, no penalties, no images, no logprobs), `step()` launches the next
step from this one's device tokens before it reads this one back, so the host's work overlaps the GPU.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .engine_ahead import RunAhead
from .engine_core import Core, Plan, Seq
from .engine_decide import Decisions
from .engine_layout import (DEFAULT_CONTEXT, DEFAULT_PAGE, GRAPH_MAX_BATCH, GRAPH_MODES,  # noqa: F401 (re-exported)
                            EngineError, Layout, cache_config, engine_layout, graph_config)
from .graphs import GraphConfig
from .sampling import SamplingParams, make_generator, small_tensor
from .speculative import SpecConfig, SpecStats, draft_chain_env
from .tp_group import LocalGroup

PROMPT_LOGPROBS_CHUNK = 128   # prompt tokens per chunk of a request with prompt logprobs (64 MB of bf16 logits at 27B)
_GRAMMAR_LOCK = threading.Lock()

if TYPE_CHECKING:
    from .vision.prompt import VisionRequest, VisionRuntime


@dataclass
class StepOutput:
    req_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None          # "stop" | "length" | None
    text: str | None = None            # incremental text (engines built with a tokenizer)
    drafted: int | None = None         # MTP drafts this request verified this step (None without MTP)
    accepted: int | None = None        # of those, accepted (the step emitted accepted + 1 tokens at most)
    logprobs: list | None = None       # ninfer_rt.logprobs.TokenLogprob per new token (params.logprobs set)
    prompt_logprobs: list | None = None  # with the first token: TokenLogprob of prompt tokens 1.. (prompt_logprobs)
    cached_tokens: int = 0             # prompt tokens resumed from the prefix cache


@dataclass
class EngineStats:
    """Prefill steps: steps that ran a prompt chunk (their first tokens count as prefill); decode: the rest."""

    prompt_tokens: int = 0
    prefill_s: float = 0.0
    decode_tokens: int = 0
    decode_s: float = 0.0
    steps: int = 0
    decode_batches: dict = field(default_factory=dict)   # decode steps per number of sequences in the step
    ahead_steps: int = 0               # decode steps that ran ahead of the host (`engine_ahead`)
    spec: SpecStats | None = None
    graphs: object = None              # GraphStats of the engine's GraphRunner (None without graphs)

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tok_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s else 0.0

    def to_dict(self) -> dict:
        d = {"prompt_tokens": self.prompt_tokens, "prefill_s": self.prefill_s, "prefill_tok_s": self.prefill_tok_s,
             "decode_tokens": self.decode_tokens, "decode_s": self.decode_s, "decode_tok_s": self.decode_tok_s,
             "steps": self.steps}
        if self.spec is not None:
            d.update(self.spec.to_dict())
        if self.graphs is not None:
            g = self.graphs
            d.update(graphs_captured=g.captured, graph_capture_s=g.capture_s, graph_replays=g.replays,
                     graph_eager_steps=g.eager_steps, graph_fallbacks=g.fallbacks,
                     graph_prefill_chunks=g.prefill_chunks, graph_rounds=g.rounds,
                     graph_fallback_reasons=dict(g.reasons))    # why steps left the graphs, not just how many
        return d


class Engine(RunAhead, Decisions, Core):
    def __init__(self, loaded, ops, tp=None, spec: SpecConfig | None = None, *, max_batch: int = 8,
                 kv_pages: int | None = None, page_size: int = DEFAULT_PAGE, max_model_len: int | None = None,
                 prefill_chunk: int = 512, tokenizer=None, vision: VisionRuntime | None = None,
                 graphs: str | GraphConfig = "auto", async_scheduling: bool | None = None,
                 grammar_tokenizer=None, prefix_cache: int = 0):
        """graphs: "auto" | "eager" | "off" | a GraphConfig (see `graph_config`); followers get the same
        `engine_layout` so every rank captures the same graphs in the same order.
        grammar_tokenizer: the vocabulary structured output reads (default: `tokenizer`; a server that
        detokenizes outside the engine passes its tokenizer here only).
        async_scheduling: launch each decode step before reading the previous one back where that is exact
        (engine_ahead.py); None = on CUDA devices (off CPU there is nothing to overlap).
        prefix_cache: how many prompt prefixes to keep for later prompts that start alike (prefix_cache.py; each
        holds its KV pages and a copy of the GDN state); 0 = off."""
        tp = tp or LocalGroup()
        if tp.rank != 0:
            raise ValueError("Engine runs on rank 0; other ranks run engine_follower.Follower")
        lay = engine_layout(loaded, ops, spec, max_batch, kv_pages, page_size, max_model_len, graphs)
        super().__init__(loaded, ops, tp, spec, lay.cache, graphs=lay.graphs, prefix_cache=prefix_cache)
        self.max_batch, self.max_model_len = max_batch, lay.max_model_len
        if not isinstance(prefill_chunk, int) or prefill_chunk < 1:
            raise EngineError(f"prefill_chunk: expected a positive integer, got {prefill_chunk!r}")
        self.prefill_chunk, self.tokenizer = prefill_chunk, tokenizer
        self.eos = frozenset(self.cfg.eos_token_ids) | (tokenizer.stop_ids if tokenizer else frozenset())
        self._grammars = None                # grammar.GrammarBackend, on the first structured request
        self._grammar_tok = grammar_tokenizer or tokenizer
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        # reset_prefix_cache() counts asks on any thread, _schedule counts those done: one writer each, no lost ask
        self._resets_asked = self._resets_done = 0
        self._free_msg: list[str] = []
        self._unusable: str | None = None    # why step() is refused from now on (None: usable)
        self.stats = EngineStats(spec=SpecStats() if spec else None,
                                 graphs=self.graphs.stats if self.graphs is not None else None)
        self.device = self.model.device
        if async_scheduling is not None and not isinstance(async_scheduling, bool):
            raise EngineError(f"async_scheduling: expected True, False or None, got {async_scheduling!r}")
        self.async_scheduling = self.device.type == "cuda" if async_scheduling is None else async_scheduling
        self.chain_drafts = draft_chain_env()
        self.vision = None
        if vision is not None:
            self.attach_vision(vision)

    # ---- public API ----
    @property
    def usable(self) -> bool:
        """False once the engine can no longer step: after a failed step with TP > 1 (the ranks may be out of
        step) or after `shutdown()`. A failed TP1 step leaves it usable (abort the requests it ran)."""
        return self._unusable is None

    def attach_vision(self, vision: VisionRuntime) -> None:
        """Accept image requests from now on (the tower runs on this rank only)."""
        if vision.config != self.cfg:
            raise EngineError("vision runtime: built from another artifact's config than this engine's")
        self.vision = vision

    @torch.no_grad()
    def add_request(self, req_id: str, prompt_ids, params: SamplingParams,
                    vision: VisionRequest | None = None) -> None:
        """`vision`: the request's images, preprocessed against `prompt_ids` (`VisionRuntime.preprocess_request`);
        the prompt is then its placeholder-expanded `token_ids`. The tower runs here, on the calling thread."""
        if req_id in self.seqs or any(s.req_id == req_id for s in self.waiting):
            raise EngineError(f"request {req_id!r}: id already in use")
        prompt = [int(t) for t in prompt_ids]
        if vision is not None:
            prompt = self._vision_prompt(req_id, prompt, vision)
        if not prompt:
            raise EngineError(f"request {req_id!r}: empty prompt")
        bad = next((t for t in prompt if not 0 <= t < self.cfg.vocab_size), None)
        if bad is not None:
            raise EngineError(f"request {req_id!r}: token id {bad} outside the vocabulary (0..{self.cfg.vocab_size - 1})")
        for name, ids in (("logit_bias", [t for t, _ in params.logit_bias]), ("allowed_token_ids",
                                                                               params.allowed_token_ids)):
            bad = next((t for t in ids if t >= self.cfg.vocab_size), None)
            if bad is not None:
                raise EngineError(f"request {req_id!r}: {name} token id {bad} outside the vocabulary "
                                  f"(0..{self.cfg.vocab_size - 1})")
        if len(prompt) >= self.max_model_len:
            raise EngineError(f"request {req_id!r}: prompt has {len(prompt)} tokens, but the context holds "
                              f"{self.max_model_len} (prompt + generated), leaving no room to generate")
        if params.stop and self.tokenizer is None:
            raise EngineError(f"request {req_id!r}: stop strings need an engine with a tokenizer")
        grammar = self._constraint(req_id, params) if params.structured else None
        s = Seq(req_id, prompt, params=params, prompt_logprobs=[] if params.prompt_logprobs is not None else None)
        if vision is not None:
            s.vision = self.vision.encode_request(vision)
        s.grammar = grammar
        if params.has_penalties:
            s.counts = torch.zeros(self.cfg.vocab_size, device=self.device)
        if params.repetition_penalty != 1:
            s.seen = torch.zeros(self.cfg.vocab_size, dtype=torch.bool, device=self.device)
            s.seen[small_tensor(prompt, torch.long, self.device)] = True
        if self.tokenizer is not None:
            from .tokenizer import TextStream
            s.stream = TextStream(self.tokenizer, params.stop, params.skip_special_tokens, params.min_tokens == 0,
                                  params.include_stop_str_in_output)
        self.waiting.append(s)

    def grammars(self):
        """The structured-output backend (ninfer_rt.grammar), built on first use; GrammarError if unavailable."""
        with _GRAMMAR_LOCK:          # the server checks grammars from worker threads
            if self._grammars is None:
                from .grammar import GrammarBackend, GrammarError
                tok = self._grammar_tok
                if tok is None:
                    raise GrammarError("structured output needs an engine with a tokenizer")
                self._grammars = GrammarBackend(tok, self.cfg.vocab_size, self.eos | tok.stop_ids)
        return self._grammars

    def _constraint(self, req_id: str, params: SamplingParams):
        from .grammar import GrammarError
        try:
            return self.grammars().constraint(params.structured, params.grammar_after)
        except GrammarError as e:
            raise EngineError(f"request {req_id!r}: {e}") from None

    def _vision_prompt(self, req_id: str, prompt: list[int], vision: VisionRequest) -> list[int]:
        """The expanded prompt; placeholder expansion may only lengthen the image runs of `prompt`."""
        if self.vision is None:
            raise EngineError(f"request {req_id!r}: has images, but this engine was started without vision "
                              "(--vision)")
        img = self.vision.image_token_id
        if [t for t in prompt if t != img] != [t for t in vision.token_ids if t != img]:
            raise EngineError(f"request {req_id!r}: the vision request was prepared from other prompt ids")
        return list(vision.token_ids)

    def abort(self, req_id: str) -> bool:
        """Drop a request now; its KV pages and GDN slot are free for the next step."""
        for s in self.waiting:
            if s.req_id == req_id:
                self.waiting.remove(s)
                return True
        s = self.seqs.get(req_id)
        if s is None:
            return False
        self._drop(s)
        self.running.remove(s)
        self._free_msg.append(req_id)
        return True

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._ahead is not None)

    @torch.no_grad()
    def step(self) -> list[StepOutput]:
        """One step for every running request. After a failed step abort the requests it ran (TP1); with
        TP > 1 the ranks may be out of step, so every later step is refused (`usable` turns False).
        Grad mode is off inside (thread-local, so the caller's own mode is left alone)."""
        if self._unusable is not None:
            raise EngineError(self._unusable)
        if not self.has_work():
            return []
        if self._ahead is None:
            plan = self._schedule()
            if not self._ahead_plan_ok(plan):
                return self._step_sync(plan)
        try:
            if self._ahead is None:
                self._ahead = self._launch([self.seqs[rid] for rid, _ in plan.decode], None)
            return self._step_ahead()
        except BaseException:
            self._ahead = None         # its sequences are out of step with the host: the caller aborts them
            raise

    def _step_sync(self, plan: Plan) -> list[StepOutput]:
        t0 = time.perf_counter()
        try:
            if self.tp.size > 1:
                self._send_plan(plan)
            results = self._execute(plan)
            if plan.prefill and self.device.type == "cuda":
                # prefill_s counts the chunk's device time. A decode step needs no sync: its read-backs already
                # order what the host reads, and the host plans the next round while the alignment runs.
                torch.cuda.synchronize(self.device)
        except BaseException:
            if self.tp.size > 1:     # followers may sit in a collective: do not message them again
                self._unusable = ("a previous engine step failed; the tensor-parallel ranks are out of step "
                                  "(restart the process)")
            raise
        self._account(plan, results, time.perf_counter() - t0)
        drafts = dict(plan.decode)
        outs = []
        for s, v, emitted in results:
            k, acc = (drafts.get(s.req_id, 0), v.n_acc) if self.spec is not None else (None, None)
            if k and s.counted is not None:          # a decode round: what it could emit (`Decisions._record`)
                k, acc = s.counted
            outs.append(self._step_output(s, emitted, k, acc))
        self.running = [s for s in self.running if not s.finished]
        return outs

    @staticmethod
    def _step_output(s: Seq, emitted: list[int], drafted: int | None, accepted: int | None) -> StepOutput:
        text = None
        if s.stream is not None:
            text, s.text_delta = s.text_delta, ""
        lps, s.logprobs = s.logprobs, None
        plps, s.prompt_logprobs = s.prompt_logprobs, None     # complete once the prompt's last chunk has run
        return StepOutput(s.req_id, emitted, s.finished, s.reason, text, drafted=drafted, accepted=accepted,
                          logprobs=lps, prompt_logprobs=plps, cached_tokens=s.cached)

    def _send_plan(self, plan: Plan) -> None:
        self.tp.broadcast_object({"op": "step", **plan.message()})
        for rid, _, meta in plan.admit:          # protocol 1b: the followers splice these embeddings
            if meta is not None:
                self.tp.broadcast(self.seqs[rid].vision.image_embeds)

    def shutdown(self) -> None:
        """Release the followers (TP); the engine is unusable afterwards."""
        if self.tp.size > 1 and self._unusable is None:
            self.tp.broadcast_object({"op": "stop"})
        self._unusable = self._unusable or "the engine was shut down"
        self._drain()
        for s in list(self.running):
            self._drop(s)
        self.running, self.waiting = [], deque()
        self._close_graphs()

    # ---- scheduling ----
    def _reserve_pages(self, s: Seq) -> int:
        # + K: a round near max_tokens may verify drafts past it (`_even_drafts`)
        extra = self.spec.num_draft_tokens if self.spec is not None else 0
        return self.model.kv_pool.pages_for(min(len(s.prompt) + s.params.max_tokens + extra, self.max_model_len))

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache before the next step's admissions (on every rank; any thread may ask: the step
        loop does it). False when the engine has no prefix cache."""
        if self.prefix is None:
            return False
        self._resets_asked += 1
        return True

    def _schedule(self) -> Plan:
        asked = self._resets_asked          # read once: an ask from another thread after this waits a step
        plan = Plan(free=self._free_msg, reset_prefix=asked != self._resets_done)
        self._free_msg, self._resets_done = [], asked
        if plan.reset_prefix:
            self.prefix.clear()
        outstanding = self._outstanding()
        while self._head_fits(outstanding):
            s = self.waiting.popleft()
            outstanding += self._reserve_pages(s)
            s.state, s.generator = self.model.new_state(), make_generator(s.params, self.device)
            self.seqs[s.req_id] = s
            self.running.append(s)
            plan.admit.append((s.req_id, s.prompt, s.vision.meta() if s.vision is not None else None))
            if self.prefix is not None and s.vision is None and s.params.prompt_logprobs is None:
                s.done_prompt = s.cached = self.prefix.resume(s.state, s.prompt, self._hashes(s))
                if s.done_prompt:
                    plan.cached.append((s.req_id, s.done_prompt))
        budget = self.prefill_chunk
        for s in self.running:
            if s.prefilling:
                if budget:
                    n = self._chunk(s, budget)
                    if s.params.prompt_logprobs is not None:     # every row's logits: [n, vocab] each chunk
                        n = min(n, PROMPT_LOGPROBS_CHUNK)
                        plan.all_rows.append(s.req_id)
                    plan.prefill.append((s.req_id, s.done_prompt, s.done_prompt + n))
                    budget -= n
            else:
                plan.decode.append((s.req_id, self._k_eff(s)))
        plan.decode = self._even_drafts(plan.decode)
        plan.chain = self.spec is not None and bool(plan.decode) and self._chainable(
            [self.seqs[rid] for rid, _ in plan.decode])
        if plan.chain and self.tp.size > 1:
            # the followers draw a chain's sampled drafts themselves, from the state the leader's draws start at
            plan.draws = [(s.req_id, s.params, s.generator.get_state()) for s in
                          (self.seqs[rid] for rid, _ in plan.decode) if not s.params.greedy]
        return plan

    def _chunk(self, s: Seq, budget: int) -> int:
        """The prompt tokens of `s` to prefill this step: up to `budget`, ending at the prompt's prefix-cache entry
        point (or where it leaves a cached prompt) when the chunk would pass it and that prefix is not cached yet."""
        n = min(budget, len(s.prompt) - s.done_prompt)
        if self.prefix is not None and s.vision is None:
            for cut in self.prefix.cuts(s.prompt, self._hashes(s)):
                if s.done_prompt < cut < s.done_prompt + n:
                    return cut - s.done_prompt
        return n

    def _outstanding(self) -> int:
        """Pages the running sequences have reserved but not taken yet."""
        return sum(max(0, self._reserve_pages(s) - len(s.state.pages)) for s in self.running)

    def _head_fits(self, outstanding: int) -> bool:
        """Whether the head of the queue can be admitted now: a batch slot, a GDN slot and its reservation."""
        return bool(self.waiting) and len(self.running) < self.max_batch and bool(self.model.gdn_pool.free_slots()) \
            and self.model.kv_pool.free_pages() - outstanding >= self._reserve_pages(self.waiting[0])

    def _admissible(self) -> bool:
        return self._head_fits(self._outstanding()) if self.waiting else False

    def _k_eff(self, s: Seq) -> int:
        """Drafts this round: K, fewer near the context or max_tokens end (0 = a plain 1-token step)."""
        if self.spec is None:
            return 0
        room_out = s.params.max_tokens - len(s.out) - 1
        return max(0, min(self.spec.num_draft_tokens, self._room_ctx(s), room_out))

    def _room_ctx(self, s: Seq) -> int:
        return self.max_model_len - s.state.length - 2

    def _even_drafts(self, decode: list[tuple[str, int]]) -> list[tuple[str, int]]:
        """With CUDA graphs, a verify step of mixed draft counts cannot replay a graph and runs eagerly (~1,500
        launches at 27B, ~100 ms against ~8): sequences near their max_tokens draft the batch's largest count
        anyway, as far as the context allows. Their extra drafts are verified but never emitted (`_accept` stops at
        max_tokens; the KV reservation holds K positions more), and the statistics count only the drafts that could
        have been (`Decisions._record`), so the tokens and the counts are those of uneven rounds."""
        if self.graphs is None or len({k for _, k in decode}) < 2:
            return decode
        top = max(k for _, k in decode)
        return [(rid, max(k, min(top, self._room_ctx(self.seqs[rid])))) for rid, k in decode]

    def _account(self, plan: Plan, results, dt: float) -> None:
        st = self.stats
        st.steps += 1
        if plan.prefill:
            st.prompt_tokens += sum(b - a for _, a, b in plan.prefill)
            st.prefill_s += dt
        else:
            st.decode_tokens += sum(len(e) for _, _, e in results)
            st.decode_s += dt
            st.decode_batches[len(results)] = st.decode_batches.get(len(results), 0) + 1
