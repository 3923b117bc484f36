"""bench/decode.py's kernel profiles: where a step's GPU time goes, by kernel, group and GEMV weight
(decode_measure.kernel_profile), for the decode step, a batch-4 step and a K = 3 verify."""
from __future__ import annotations

import decode_measure as M
import torch


def profile(model, runner, st, ctx, opts, base, emit) -> None:
    """Where the GPU time goes: the decode step, and the two T = 4 steps: batch-4 serving (four sequences, one
    token each; the bench captures batch 1 only, so the model's eager forward) and a K = 3 verify (one
    sequence, four tokens, GDN snapshots). Graph replays (kernels inside graphs are traced by recent CUPTI)."""
    from ninfer_rt.model import SeqInput
    tok, four = torch.tensor([1]), torch.ones(4, dtype=torch.long)

    def verify():
        runner.forward([SeqInput(four, st, snapshot=True)])
        st.commit(4)
    _profile_one(runner, st, ctx, lambda: runner.forward([SeqInput(tok, st)]), "decode", base, emit,
                 eager=lambda: runner.model.forward([SeqInput(tok, st)]))
    extra = []
    try:
        for _ in range(3):
            extra.append(model.new_state())
            M.fill_context(model, extra[-1], ctx)
        _profile_one(runner, st, ctx, lambda: runner.forward([SeqInput(tok, s) for s in (st, *extra)]), "batch 4",
                     {**base, "batch": 4}, emit)
    except Exception as e:                      # noqa: BLE001 - a diagnostic; never fails the run
        emit({**base, "kind": "profile", "context": ctx, "step": "batch 4", "note": f"{type(e).__name__}: {e}"})
    finally:
        for s in extra:
            s.free()
    if "verify" in opts.parts and opts.max_draft >= 3:
        _profile_one(runner, st, ctx, verify, "verify K=3", {**base, "draft_tokens": 3}, emit)


def _linear_labels(model) -> list[str]:
    """The step's GEMV launches in order, named as bench/kernels.py names their shapes (ninfer_rt/layers)."""
    out = []
    for b in model.blocks:
        out += ["attn_qkv", "attn_o"] if b.full else ["gdn_qkvz", "gdn_out"]
        out += ["mlp_gate_up", "mlp_down"]
    return out + ["lm_head"]


def _profile_one(runner, st, ctx, step, name, base, emit, eager=None) -> None:
    """eager: what to profile instead when the graph replays trace no kernels (older CUPTI)."""
    try:
        before = runner.stats.fallbacks
        prof = M.kernel_profile(step, 8, linear_labels=_linear_labels(runner.model))
        how = "graph replay" if runner.stats.fallbacks == before else "eager model.forward (no graph for it)"
        if not prof and eager is not None:
            prof, how = M.kernel_profile(eager, 8), "eager model.forward"
        emit({**base, "kind": "profile", "context": ctx, "step": name, "source": how, **prof})
    except Exception as e:                      # noqa: BLE001 - a diagnostic; never fails the run
        emit({**base, "kind": "profile", "context": ctx, "step": name,
              "note": f"profiler failed: {type(e).__name__}: {e}"})
    M.rewind(st, ctx)
