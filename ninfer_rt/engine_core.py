"""Step execution shared by every TP rank: the model calls of one engine step, in a fixed order.

All ranks run the same calls on their shards. The few decisions (the plan, the drafted tokens, the verdict
of a verify) are made by rank 0 (`Engine`) and received by the others (`Follower`); these are the three
`_decide_*` hooks. With TP1 the decisions are simply made locally.

One step = [draft phase (MTP, spec only)] -> one target forward over every decode sequence ([t_0] or
[t_0, d_1..d_k] with snapshots) and every scheduled prefill chunk -> verdict (accepted count, target token,
emitted count, finished) -> commit / free -> one MTP forward aligning decode rounds and prefill chunks.

Step protocol (TP > 1, all over the CPU gloo control group, rank 0 -> everyone):
  1. object  {"op": "step", "admit": [(req_id, prompt ids, vision meta | None)], "free": [req_id],
             "prefill": [(req_id, a, b)], "decode": [(req_id, k)]}   or  {"op": "stop"}
  1b. for every admitted image prompt, in admit order: its merged vision tokens [n, H] (`meta["embeds_shape"]`,
     `meta["embeds_dtype"]`); only rank 0 runs the tower, so every rank splices the same embeddings
  2. unless the plan says "chain": for j = 1..max k: int64 [n_j]  the j-th drafts of the decode sequences with
     k >= j, in plan order. "chain" (every decode sequence drafts from its logits alone: no penalties, bias, bans
     or grammar): each rank finds the drafts itself from the same all-gathered draft logits and keeps them on the
     device (`_draft_chained`): a greedy row's argmax, a sampled row's draw, for which the plan's "draws" carry
     the row's SamplingParams and its generator's state at the step's start, so every rank draws the leader's
     noise (and so its drafts; a sampled round graph decides the verdict alike on every rank too)
  3. if anything was scheduled: int64 [n_decode + n_prefill, 4] verdict rows (n_acc, token, n_emit, finished)
Followers draw only a chain's drafts, from the leader's generator states; they apply the same plan, drafts and
verdicts to their shards.

CUDA graphs (`graphs=GraphConfig`, built by engine_layout.engine_layout): every rank makes a GraphRunner after the
Model and captures the same graphs in the same order (under TP they hold the all-reduces). The decode /
verify rows of a step and its prefill chunks then go to separate forwards (`forward_parts`): the decode part
replays a graph (the runner falls back to the model for what it cannot serve: ragged verify sizes, image
positions, ...), the chunks run eagerly. The same split applies to the MTP alignment (whose ragged counts the
runner pads into one graph); draft steps go to the runner whole. With `GraphConfig.round_drafts`, a chained round
of the captured K (every decode sequence drafting K) drafts and verifies in one graph instead (`engine_round`).
Without graphs a step stays one forward, as before.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .engine_round import Rounds
from .logprobs import emitted_items, prompt_items
from .model import Model, MtpInput, SeqInput
from .sampling import SamplingParams, process, sample, small_tensor
from .speculative import SpecConfig, SpecError
from .state import CacheConfig
from .step_out import StepOut

if TYPE_CHECKING:
    from .graphs import GraphConfig
    from .vision.prompt import VisionPrompt


@dataclass(eq=False)
class Seq:
    req_id: str
    prompt: list[int]
    state: object = None                 # SeqState
    done_prompt: int = 0                 # prompt tokens already in the target state
    cached: int = 0                      # of those, resumed from the prefix cache
    hashes: list | None = None           # the prompt's page hashes (prefix cache), computed on first use
    last: int | None = None              # last emitted token, not yet fed to the target
    mtp_logits: torch.Tensor | None = None   # [V] MTP logits for the next round's first draft
    mtp_hidden: torch.Tensor | None = None   # [H] MTP output hidden paired with them
    vision: VisionPrompt | None = None   # image prompt: MRoPE positions and the embeddings spliced at its rows
    # leader only
    params: object = None
    out: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    counts: torch.Tensor | None = None
    seen: torch.Tensor | None = None         # bool [V]: the prompt's tokens (params.repetition_penalty != 1)
    grammar: object = None                   # grammar.Constraint of a structured-output request
    stream: object = None
    text_delta: str = ""
    q: list = field(default_factory=list)     # draft distributions of the current round
    logprobs: list | None = None         # TokenLogprob of this step's emitted tokens (params.logprobs set)
    prompt_logprobs: list | None = None  # TokenLogprob of prompt tokens 1.. so far (params.prompt_logprobs set)
    finished: bool = False
    reason: str | None = None
    counted: tuple[int, int] | None = None   # the last round's (drafts, accepted) that could be emitted

    @property
    def prefilling(self) -> bool:
        return self.done_prompt < len(self.prompt)


@dataclass
class Plan:
    admit: list = field(default_factory=list)     # (req_id, prompt ids, VisionPrompt.meta() or None)
    free: list = field(default_factory=list)      # req_ids (aborted)
    prefill: list = field(default_factory=list)   # (req_id, start, end)
    decode: list = field(default_factory=list)    # (req_id, k drafts)
    chain: bool = False                           # drafts stay on the device between draft steps (`_draft_chained`)
    all_rows: list = field(default_factory=list)  # req_ids whose prompt chunks return every row's logits
    cached: list = field(default_factory=list)    # (req_id, n): admitted at n tokens from the prefix cache
    reset_prefix: bool = False                    # empty the prefix cache before this step's admissions
    draws: list = field(default_factory=list)     # TP chain: (req_id, SamplingParams, generator state) per
                                                  # sampled decode row (`Follower._take_draws`)

    def message(self) -> dict:
        return {"admit": self.admit, "free": self.free, "prefill": self.prefill, "decode": self.decode,
                "chain": self.chain, "all_rows": self.all_rows, "cached": self.cached,
                "reset_prefix": self.reset_prefix, "draws": self.draws}


@dataclass
class Verdict:
    n_acc: int          # accepted drafts
    token: int          # target token after them (the first token for a final prefill chunk; -1 none)
    n_emit: int         # tokens emitted = target columns committed
    finished: bool

    def emitted(self, drafts: list[int]) -> list[int]:
        return (drafts[:self.n_acc] + [self.token])[:self.n_emit]


GREEDY = SamplingParams(temperature=0.0)     # a follower's row without the leader's parameters: greedy


def _greedy(s: Seq) -> bool:
    return s.params is None or s.params.greedy


def _draft_counts(s: Seq, toks: list) -> torch.Tensor | None:
    """A penalized row's counts for its next draft: the generated tokens' and the round's earlier device drafts
    (`speculative.column_counts`' last column, without a host read-back)."""
    if s.params is None or not s.params.has_penalties or s.counts is None:
        return None
    if not toks:
        return s.counts
    ids = torch.cat(toks)
    return s.counts.index_add(0, ids, torch.ones(ids.numel(), dtype=s.counts.dtype, device=s.counts.device))


def draw(seqs: list[Seq], q: torch.Tensor) -> torch.Tensor:
    """One draft per row of the processed draft distributions q (each sequence's generator, in row order); the
    sampled rows keep their distribution for the verdict's rejection sampling."""
    toks = sample(q, [s.params or GREEDY for s in seqs], [s.generator for s in seqs])
    for s, row in zip(seqs, q):
        if not _greedy(s):
            s.q.append(row)
    return toks


def forward_parts(n_dec: int, n: int, graphs: bool) -> list[tuple[int, int, bool]]:
    """How one step's n sequences (the n_dec decode/verify rows first, then prefill chunks) are split into
    forwards: (lo, hi, through the graph runner). Without graphs: one forward, as the plain engine runs it."""
    if not 0 <= n_dec <= n:
        raise ValueError(f"forward_parts: {n_dec} decode rows out of {n}")
    if not graphs:
        return [(0, n, False)] if n else []
    return [p for p in ((0, n_dec, True), (n_dec, n, False)) if p[1] > p[0]]


def _ids(x) -> torch.Tensor:
    """Token ids as an int64 tensor: a list from the host, or a tensor as it is (a draft still on the device)."""
    return x if isinstance(x, torch.Tensor) else torch.tensor(x, dtype=torch.long)


def _round_ids(last: int, drafts):
    """A decode row's ids [t_0, d_1..d_k]: a host list, or a device tensor when the drafts are still there."""
    if isinstance(drafts, torch.Tensor):
        return torch.cat([small_tensor([last], torch.long, drafts.device), drafts])
    return [last] + drafts


def _read_back_drafts(drafts: list, ids: torch.Tensor | None) -> tuple[list[list[int]], list[int] | None]:
    """The step's device drafts and the verdict's queued argmax (or None) in one transfer -> (host drafts, host
    argmax or None). Host drafts pass through."""
    dev = [d for d in drafts if isinstance(d, torch.Tensor)]
    if not dev and ids is None:
        return drafts, None
    flat = torch.cat(dev + ([ids] if ids is not None else [])).tolist()
    out, o = [], 0
    for d in drafts:
        if isinstance(d, torch.Tensor):
            out.append(flat[o:o + d.numel()])
            o += d.numel()
        else:
            out.append(d)
    return out, (flat[o:] if ids is not None else None)


class Core(Rounds):
    """Owns the model and the per-rank sequence states; subclasses make the decisions."""

    def __init__(self, loaded, ops, tp, spec: SpecConfig | None, cache: CacheConfig,
                 graphs: GraphConfig | None = None, prefix_cache: int = 0):
        if spec is not None and (loaded.config.mtp_num_hidden_layers == 0
                                 or not any(n.startswith("mtp.") for n in loaded.weights)):
            raise SpecError(f"{getattr(loaded, 'path', 'artifact')}: speculative decoding needs the MTP "
                            f"module, and this artifact has none (packed without mtp.* tensors)")
        self.cfg = loaded.config
        self.model = Model(loaded.config, loaded.weights, ops, tp, cache=cache)
        self.tp, self.spec, self.cache = tp, spec, cache
        self.seqs: dict[str, Seq] = {}
        self._argmax: list[int] | None = None     # this step's target argmax, read back with its drafts
        self.prefix = None            # PrefixCache with prefix_cache entries (0: off)
        if prefix_cache:
            from .prefix_cache import PrefixCache
            self.prefix = PrefixCache(self.model.kv_pool, self.model.gdn_pool, prefix_cache)
        self.graphs = None
        if graphs is not None:
            from .graphs import GraphRunner
            self.graphs = GraphRunner(self.model, graphs)
            self.graphs.capture()           # every rank, same order: no-op in eager mode

    # ---- decisions (overridden) ----
    def _device_drafts(self, j: int, items: list[tuple[Seq, torch.Tensor, list]]) -> torch.Tensor:
        """The j-th drafts of `items` as an int64 [n] device tensor, without a host read-back: the argmax of each
        greedy row, a sampled row's draw from its processed distribution (kept for the verdict). With TP every
        rank holds the same gathered logits and (followers: the plan's draws) the same generator states, so every
        rank finds the same drafts."""
        seqs = [s for s, _, _ in items]
        if j == 1:
            for s in seqs:
                s.q = []
        if all(s.params is None or s.params.plain_greedy for s in seqs):
            return torch.stack([lg.argmax(-1) for _, lg, _ in items])
        # a chain's rows: no bans, bias or grammar; penalty counts (TP1) see the round's earlier drafts
        params = [s.params or GREEDY for s in seqs]
        counts = [_draft_counts(s, toks) for s, _, toks in items]
        return draw(seqs, process(torch.stack([lg for _, lg, _ in items]), params, counts))

    def _decide_drafts(self, j: int, items: list[tuple[Seq, torch.Tensor, list[int]]]) -> list[int]:
        raise NotImplementedError

    def _decide_verdicts(self, dec, drafts, pre, out) -> list[Verdict]:
        raise NotImplementedError

    def _target_argmax(self, dec, pre, out, skip: int = 0) -> torch.Tensor | None:
        """The argmax of every logits row the verdicts will read, queued on the device, past the first `skip`
        verified sequences (None: not needed)."""
        return None

    def _take_logprobs(self, items: list, prompt_items: list) -> None:
        """The leader's: (sequence, its logits rows, the tokens they chose) of requests that asked for logprobs
        (`items`: emitted tokens) or prompt logprobs (`prompt_items`: the prompt's next tokens)."""

    def _receive_vision(self, meta: dict) -> VisionPrompt:
        """A follower's copy of an admitted image prompt (rank 0 encodes it and sends the embeddings)."""
        raise NotImplementedError

    # ---- plan application ----
    def _apply_membership(self, plan: Plan) -> None:
        for rid in plan.free:
            s = self.seqs.pop(rid, None)
            if s is not None and s.state is not None:
                s.state.free()
        if plan.reset_prefix:
            self.prefix.clear()
        cached = dict(plan.cached)
        for rid, prompt, meta in plan.admit:
            s = Seq(rid, list(prompt), state=self.model.new_state())
            if meta is not None:
                s.vision = self._receive_vision(meta)
            if rid in cached:
                s.done_prompt = self.prefix.resume(s.state, s.prompt, self._hashes(s), cached[rid])
            self.seqs[rid] = s

    def _hashes(self, s: Seq) -> list[int]:
        if s.hashes is None:
            s.hashes = self.prefix.hashes(s.prompt)
        return s.hashes

    def _keep_prefix(self, pre: list) -> None:
        """Cache the prompts whose prefill just stopped at one of their cut points (every rank, in plan order)."""
        for s, _, b in pre:
            mtp = s.state.mtp if self.spec is not None else None      # without MTP its cache stays empty
            if s.vision is None and b == s.state.length and (mtp is None or mtp.length == b) and \
                    b in self.prefix.cuts(s.prompt, self._hashes(s)):
                self.prefix.insert(s.state, s.prompt, self._hashes(s), b)

    # ---- per-sequence model arguments ----
    def _seq_input(self, s: Seq, ids: list[int], **kw) -> SeqInput:
        """Rows state.length .. +len(ids) of `s`; image prompts bring MRoPE positions and spliced embeddings."""
        t = _ids(ids)
        if s.vision is not None:
            kw.update(s.vision.seq_kwargs(self.model, s.state.length, t))
        return SeqInput(t, s.state, **kw)

    @staticmethod
    def _mtp_input(s: Seq, ids: list[int], hidden: torch.Tensor, **kw) -> MtpInput:
        """MTP row p pairs target row p, so it takes the target's position for that row. At image rows the MTP
        embeds the placeholder token itself (MtpInput takes no embeddings): that only shapes the MTP cache and
        so the drafts, never the output, which verification keeps lossless."""
        if s.vision is not None:
            kw["positions"] = s.vision.positions_for(s.state.mtp.length, len(ids))
        return MtpInput(_ids(ids), hidden, s.state.mtp, **kw)

    def _execute(self, plan: Plan) -> list[tuple[Seq, Verdict, list[int]]]:
        """Run one step; returns (seq, verdict, emitted tokens) for every sequence that emitted or ended."""
        dec = [(self.seqs[rid], k) for rid, k in plan.decode]
        pre = [(self.seqs[rid], a, b) for rid, a, b in plan.prefill]
        starts = [s.state.length for s, _ in dec]
        self._decided = None
        rnd = self._round(dec, plan.chain)
        drafts = self._draft(dec, plan.chain) if rnd is None else []
        inputs = [self._seq_input(s, _round_ids(s.last, d), snapshot=k > 0) for (s, k), d in zip(dec, drafts)]
        rows = set(plan.all_rows)
        inputs += [self._seq_input(s, s.prompt[a:b], logits="all" if s.req_id in rows else
                                   "last" if b == len(s.prompt) else "none") for s, a, b in pre]
        if rnd is not None:
            out, drafts = self._round_rest(dec, pre, inputs, *rnd)
        else:
            out = self._forward(inputs, len(dec))
            # device drafts are read back once the verify step is queued, with the verdict's argmax behind it
            drafts, self._argmax = _read_back_drafts(drafts, self._target_argmax(dec, pre, out))
        verdicts = self._decide_verdicts(dec, drafts, pre, out)
        self._take_logprobs(emitted_items(dec, pre, verdicts, drafts, out), prompt_items(pre, rows, out, len(dec)))
        results, mtp_in, mtp_seqs = [], [], []
        for i, ((s, k), d, v, L) in enumerate(zip(dec, drafts, verdicts, starts)):
            if k > 0:
                s.state.commit(v.n_emit)
            emitted = v.emitted(d)
            results.append((s, v, emitted))
            if v.finished:
                continue
            s.last = emitted[-1]
            if self.spec is not None:
                s.state.mtp.rewind(L)
                mtp_in.append(self._mtp_input(s, emitted, out.seq_hidden(i)[:v.n_emit], logits="last"))
                mtp_seqs.append(s)
        n_round = len(mtp_in)
        for i, ((s, a, b), v) in enumerate(zip(pre, verdicts[len(dec):]), start=len(dec)):
            s.done_prompt = b
            final = b == len(s.prompt)
            if final:
                results.append((s, v, [v.token]))
                s.last = v.token
            if v.finished or self.spec is None:
                continue
            nxt = s.prompt[a + 1:b] + [v.token if final else s.prompt[b]]
            mtp_in.append(self._mtp_input(s, nxt, out.seq_hidden(i), logits="last" if final else "none"))
            mtp_seqs.append(s if final else None)
        self._align(mtp_in, mtp_seqs, n_round)
        if self.prefix is not None:
            self._keep_prefix(pre)
        for s, v, _ in results:
            if v.finished:
                self._drop(s)
        return results

    def _forward(self, batch: list, n_dec: int, mtp: bool = False) -> StepOut:
        """The step's target (or MTP alignment) forward over `batch`, its first n_dec rows decode rounds."""
        parts = []
        for lo, hi, via_graph in forward_parts(n_dec, len(batch), self.graphs is not None):
            owner = self.graphs if via_graph else self.model
            run = owner.mtp_forward if mtp else owner.forward
            if not mtp and not via_graph and self.graphs is not None:
                run = self.graphs.prefill          # short chunks as graph steps, the rest eagerly
            parts.append((lo, run(batch[lo:hi])))
        return StepOut(parts)

    def _align(self, mtp_in: list[MtpInput], mtp_seqs: list, n_round: int) -> None:
        """MTP over the committed tokens with target hiddens; keep each sequence's next-draft inputs.
        The first n_round inputs continue decode rounds (graph-served when their token counts agree)."""
        if not mtp_in:
            return
        mo = self._forward(mtp_in, n_round, mtp=True)
        for b, s in enumerate(mtp_seqs):
            if s is not None:
                s.mtp_logits = mo.seq_logits(b)[-1]
                s.mtp_hidden = mo.seq_hidden(b)[-1]

    def _draft(self, dec: list[tuple[Seq, int]], chain: bool = False) -> list:
        """Recursive MTP drafting; d_1 comes from the alignment of the previous step. -> host lists, or with
        `chain` device tensors (`_draft_chained`)."""
        if dec and chain:
            return self._draft_chained(dec)
        drafts: list[list[int]] = [[] for _ in dec]
        logits = [s.mtp_logits for s, _ in dec]
        hidden = [s.mtp_hidden for s, _ in dec]
        for j in range(1, max((k for _, k in dec), default=0) + 1):
            idx = [i for i, (_, k) in enumerate(dec) if k >= j]
            toks = self._decide_drafts(j, [(dec[i][0], logits[i], drafts[i]) for i in idx])
            for i, t in zip(idx, toks):
                drafts[i].append(int(t))
            more = [i for i in idx if dec[i][1] > j]
            if more:
                step = self.graphs if self.graphs is not None else self.model
                mo = step.mtp_forward([self._mtp_input(dec[i][0], [drafts[i][-1]], hidden[i][None])
                                       for i in more])
                for r, i in enumerate(more):
                    logits[i], hidden[i] = mo.logits[r], mo.hidden[r]
        return drafts

    def _draft_chained(self, dec: list[tuple[Seq, int]]) -> list[torch.Tensor]:
        """`_draft` without a host read-back: each draft stays on the device and is the next MTP step's input,
        so the host queues step j + 1 while step j runs. -> int64 [k] device tensors, one per sequence, which
        the verify step takes as its input ids; they are read back once it is queued (`_execute`)."""
        toks: list[list[torch.Tensor]] = [[] for _ in dec]
        logits = [s.mtp_logits for s, _ in dec]
        hidden = [s.mtp_hidden for s, _ in dec]
        for j in range(1, max(k for _, k in dec) + 1):
            idx = [i for i, (_, k) in enumerate(dec) if k >= j]
            new = self._device_drafts(j, [(dec[i][0], logits[i], toks[i]) for i in idx])
            for r, i in enumerate(idx):
                toks[i].append(new[r:r + 1])
            more = [i for i in idx if dec[i][1] > j]
            if more:
                step = self.graphs if self.graphs is not None else self.model
                mo = step.mtp_forward([self._mtp_input(dec[i][0], toks[i][-1], hidden[i][None]) for i in more])
                for r, i in enumerate(more):
                    logits[i], hidden[i] = mo.logits[r], mo.hidden[r]
        empty = torch.zeros(0, dtype=torch.long, device=self.model.device)
        return [torch.cat(row) if row else empty for row in toks]

    def _close_graphs(self) -> None:
        if self.graphs is not None:
            self.graphs.close()

    def _drop(self, s: Seq) -> None:
        if s.state is not None:
            s.state.free()
            s.state = None
        self.seqs.pop(s.req_id, None)
