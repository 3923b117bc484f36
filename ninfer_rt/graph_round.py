"""A greedy MTP round as one CUDA graph: the K - 1 chained draft steps and the verify step of K drafts.

Run as separate graphs, a round of K = 3 costs the host three launches, three metadata fills, two hidden copies,
output clones and a handful of argmax / stack / cat launches before the verify starts, and each draft step waits
for the host to queue the next (a draft step is ~0.45 ms of GPU on a 27B H100). Measured (bench/NOTES.md §45): the
host's work per round 476 -> 302 us on a CPU box; on an H100, whose rounds were already 97-98 % GPU-busy, the GPU's
gaps 0.24 -> 0.15 ms per round (+0.6-0.9 % tok/s). Captured together, the drafts never leave the device: the graph takes
the argmax of the previous alignment's logits (d_1), runs draft step j on (d_j, its hidden) and takes its argmax
(d_{j+1}), writes d_1..d_K behind t_0 into the verify's ids, runs the verify with snapshot rows, and takes the
argmax of every verify row. The host fills the metadata (one buffer per draft step, plus the verify's), copies the
two inputs, replays once and reads the drafts and the argmax back in one transfer.

Only rounds whose drafts one argmax decides (the engine's chain: greedy, no penalties, bias or grammar) and
whose sequences all draft the captured K go this way (`GraphConfig.round_drafts`); anything else takes the
separate steps, with the same tokens. `NINFER_ROUND_GRAPHS=0` turns it off (the comparison run; engine_layout).
Rounds with sampled rows take the sampled round graphs (key kinds "sround" / "tround", `graph_round_sampled`), which
draw the drafts and decide the verdicts inside the graph.

Packed output (int64, one device tensor): the padded batch's drafts [B, K] row by row, then the verify argmax
[B * (K + 1)], and in a sampled round each padded row's (accepted drafts, token); it stays valid until the next
replay of any graph (they share one memory pool).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import graph_round_sampled as sampled_round
from .graph_model import RowSpec, StaticMeta, mtp_step, target_step
from .state import PendingSnapshot


@dataclass
class RoundRow:
    """One sequence's round: its unfed last token, its state, and the alignment's outputs for d_1."""

    last: int
    state: object                 # SeqState (its .mtp drafts)
    logits: torch.Tensor          # [V] MTP logits whose argmax is d_1
    hidden: torch.Tensor          # [H] MTP hidden paired with them
    params: object = None         # SamplingParams (None: greedy, as a TP follower's greedy rows)
    generator: object = None      # the request's torch.Generator (sampled rows)
    counts: object = None         # float32 [V] generated-token counts of a penalized row (presence / frequency)

    @property
    def sampled(self) -> bool:
        return self.params is not None and not self.params.greedy


def draft_metas(runner, k: int) -> list[StaticMeta]:
    """Metadata buffers of the K - 1 draft steps (one token per row each), beside the verify's `runner.meta`."""
    m = runner.meta
    return [StaticMeta(m.max_batch, 1, m.max_pages, m.page_size, m.scratch_pages.tolist(), m.scratch_slot,
                       m.device) for _ in range(k - 1)]


def body(runner, b: int, k: int, bucket: int, host, kind: str = "round"):
    """The round over the static buffers -> (verify hidden [b(K+1), H], verify logits, packed int64). host: None
    when capturing, else (verify KV lengths, snapshot rows, each draft step's KV lengths) for an eager run.
    kind "sround" / "tround": the drafts drawn and the verdicts decided in the graph (`graph_round_sampled`)."""
    model, meta, t = runner.model, runner.meta, k + 1
    kv, snaps, kv_drafts = host if host is not None else ((bucket,) * b, (-1,) * b, [(bucket,) * b] * (k - 1))
    sampled = kind != "round"
    pick = sampled_round.Drafter(runner.sampled, b, kind == "sround") if sampled else (lambda lg, j: lg.argmax(-1))
    d = pick(runner.round_logits[:b], 0)
    drafts, h = [d], runner.mtp_hidden[:b]
    for j, dm in enumerate(runner.draft_meta):
        dm.ids[:b].copy_(d)
        h, logits = mtp_step(model, dm, dm.mtp_ctx(b, 1, kv_drafts[j]), h, b, 1)
        d = pick(logits, j + 1)
        drafts.append(d)
    ids = torch.stack(drafts, 1)
    meta.ids[:b * t].view(b, t)[:, 1:].copy_(ids)
    pool = model.gdn_pool
    ctx = meta.target_ctx(b, t, kv, snaps, *((pool.conv, pool.rec) if runner.snap_base is not None else ()))
    hidden, logits = target_step(model, meta, ctx, b * t)
    am = logits.argmax(-1)
    packed = [ids.reshape(-1), am] + ([pick.verdicts(ids, logits, am).reshape(-1)] if sampled else [])
    return hidden, logits, torch.cat(packed)


def _need(rows: list[RoundRow], k: int) -> int:
    """The KV length the round reaches: the verify's, or a draft step's (the MTP cache trails the target)."""
    return max(max(r.state.length + k + 1, r.state.mtp.length + k - 1) for r in rows)


def why_not(runner, rows: list[RoundRow], k: int) -> str:
    """'' when a round graph serves `rows`, else the reason it does not."""
    if k != runner.cfg.round_drafts or not runner.mtp_tokens or runner._scratch.freed:
        return "no round graph for this K"
    if not rows or len(rows) > runner.max_batch:
        return "batch size"
    if runner._bucket(_need(rows, k)) is None:
        return "context past the largest KV bucket"
    if runner.snap_base is None:
        return "snapshots not configured"
    runner._pending = [(st, p) for st, p in runner._pending if st.pending is p and not st.freed]
    if runner._pending:
        return "snapshot buffers in use"
    return sampled_round.why_not(runner, rows) if any(r.sampled for r in rows) else ""


def run(runner, rows: list[RoundRow], k: int):
    """One round through its graph -> (the verify's Output, packed drafts and argmax), or None (reason counted
    in `runner.stats.reasons` as 'round: ...') when the separate steps must run it."""
    why = why_not(runner, rows, k)
    if why:
        runner.stats.reasons["round: " + why] = runner.stats.reasons.get("round: " + why, 0) + 1
        return None
    model, t, B = runner.model, k + 1, runner._pad(len(rows))
    sampled = any(r.sampled for r in rows)
    kind = sampled_round.kind(rows, runner.round_logits.shape[-1]) if sampled else "round"
    key = (kind, B, k, runner._bucket(_need(rows, k)))
    ids = [torch.tensor([r.last] + [0] * k, dtype=torch.long) for r in rows]
    model._admit([(i, r.state, "all") for i, r in zip(ids, rows)])
    if k > 1:
        model._admit([(i[:k - 1], r.state.mtp, "all") for i, r in zip(ids, rows)], mtp=True)
    snap = [runner.snap_base + b * t for b in range(len(rows))]
    runner._protect(rows, snap, t)
    for b, r in enumerate(rows):
        runner.round_logits[b].copy_(r.logits, non_blocking=True)
        runner.mtp_hidden[b].copy_(r.hidden, non_blocking=True)
    if sampled:
        sampled_round.fill(runner.sampled, rows, k)
    starts = [r.state.mtp.length for r in rows]
    zero = torch.zeros(1, dtype=torch.long)
    for j, dm in enumerate(runner.draft_meta):
        dm.fill([RowSpec(zero, s + j, r.state.pages) for s, r in zip(starts, rows)], B, 1)
    verify = [RowSpec(i, r.state.length, r.state.pages, r.state.gdn_row, o) for i, r, o in zip(ids, rows, snap)]
    kv_drafts = [tuple(s + j + 1 for s in starts) + (1,) * (B - len(rows)) for j in range(k - 1)]
    hidden, logits, packed = runner._run(key, verify, t, kv_drafts)
    pool = model.gdn_pool
    for r, o in zip(rows, snap):
        r.state.mtp.length += k - 1
        r.state.pending = PendingSnapshot(t, pool.conv, pool.rec, o)
        runner._pending.append((r.state, r.state.pending))
        runner._lazy[r.state] = None
    runner.stats.rounds += 1
    runner.stats.sampled_rounds += sampled
    return runner._output(hidden, logits, [t] * len(rows), t, ["all"] * len(rows)), packed


def read_back(packed: torch.Tensor, n: int, padded: int, k: int, sampled: bool = False):
    """The packed output (and anything appended to it), one transfer -> (each of the n real rows' K drafts, their
    verify argmax row-major, a sampled round's [accepted drafts, token] per real row (else None), the values
    appended after the padded batch's)."""
    flat, t = packed.tolist(), k + 1
    end = padded * (k + t)
    decided = None
    if sampled:
        decided = [flat[end + 2 * i:end + 2 * i + 2] for i in range(n)]
        end += 2 * padded
    return [flat[i * k:(i + 1) * k] for i in range(n)], flat[padded * k:padded * k + n * t], decided, flat[end:]
