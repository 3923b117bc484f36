"""Sampling parameters, processed distributions, seeded sampling, and the speculative acceptance rules."""
import dataclasses
import math

import numpy as np
import pytest
import torch

from ninfer_rt.sampling import SamplingError, SamplingParams, make_generator, process, sample, token_counts
from ninfer_rt.spec_verify import greedy_verify, rejection_verify

TV_TOL = 0.01          # total-variation bound for 200k draws over <= 8 outcomes (expected TV ~ 0.003)
PROB_TOL = 1e-6


def _ref_distribution(logits: np.ndarray, p: SamplingParams, counts=None) -> np.ndarray:
    """Straightforward per-row reference: penalties, temperature, top-k, top-p, min-p, renormalise."""
    x = logits.astype(np.float64).copy()
    if counts is not None:
        x -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
    if p.temperature == 0:
        out = np.zeros_like(x)
        out[np.argmax(x)] = 1
        return out
    e = np.exp((x - x.max()) / p.temperature)
    probs = e / e.sum()
    order = np.argsort(-probs, kind="stable")
    keep = np.zeros(len(x), bool)
    mass, kept = 0.0, []
    k = p.top_k or len(x)
    top_mass = probs[order[:k]].sum()
    for rank, i in enumerate(order[:k]):
        if rank > 0 and mass / top_mass >= p.top_p:
            break
        kept.append(i)
        mass += probs[i]
    for i in kept:
        keep[i] = probs[i] >= p.min_p * probs[order[0]]
    out = np.where(keep, probs, 0)
    return out / out.sum()


PARAMS = {
    "greedy": SamplingParams(temperature=0),
    "temp0.7": SamplingParams(temperature=0.7),
    "topk5": SamplingParams(temperature=1.3, top_k=5),
    "topp0.6": SamplingParams(top_p=0.6),
    "minp0.2": SamplingParams(temperature=0.9, min_p=0.2),
    "all": SamplingParams(temperature=0.8, top_k=9, top_p=0.85, min_p=0.05),
    "penalties": SamplingParams(temperature=1.1, presence_penalty=0.7, frequency_penalty=-0.4),
    "greedy_pen": SamplingParams(temperature=0, presence_penalty=1.5, frequency_penalty=0.5),
}


BATCHES = {"mixed": list(PARAMS), "all-greedy": ["greedy", "greedy_pen", "greedy"],
           "all-sampled": [n for n in PARAMS if PARAMS[n].temperature > 0]}


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("vocab", [37, 250])
def test_process_matches_reference_batched(vocab, batch):
    """Batches mixing parameter kinds, or all greedy / all sampled (their own code paths); each row equals
    the per-row reference."""
    g = torch.Generator().manual_seed(vocab)
    names = BATCHES[batch]
    logits = torch.randn(len(names), vocab, generator=g) * 3
    hist = [torch.randint(0, vocab, (11,), generator=g).tolist() for _ in names]
    counts = [token_counts(h, vocab, "cpu") for h in hist]
    probs = process(logits, [PARAMS[n] for n in names], counts)
    assert probs.shape == (len(names), vocab) and probs.dtype == torch.float32
    for r, n in enumerate(names):
        ref = _ref_distribution(logits[r].numpy(), PARAMS[n], counts[r].numpy())
        np.testing.assert_allclose(probs[r].numpy(), ref, atol=PROB_TOL, err_msg=n)


def test_truncation_keeps_only_top_tokens():
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0, 0.0, -1.0]])
    p = process(logits, [SamplingParams(top_k=3)])[0]
    assert (p[3:] == 0).all() and (p[:3] > 0).all() and abs(p.sum().item() - 1) < PROB_TOL
    p = process(logits, [SamplingParams(top_p=1e-6)])[0]      # the top token always survives
    assert p[0].item() == pytest.approx(1.0)
    p = process(logits, [SamplingParams(min_p=0.3)])[0]       # e^-1 = 0.37 >= 0.3, e^-2 < 0.3
    assert (p[:2] > 0).all() and (p[2:] == 0).all()


def test_penalties_change_greedy_choice():
    logits = torch.tensor([[2.0, 1.9, 0.0, -5.0]])
    counts = [token_counts([0, 0, 3], 4, "cpu")]
    assert sample(process(logits, [PARAMS["greedy"]], counts), [PARAMS["greedy"]], [None]).item() == 0
    pen = SamplingParams(temperature=0, presence_penalty=0.05, frequency_penalty=0.05)
    assert sample(process(logits, [pen], counts), [pen], [None]).item() == 1


def test_sampled_frequencies_follow_processed_distribution():
    torch.manual_seed(0)
    p = SamplingParams(temperature=0.7, top_k=6, seed=3)
    logits = torch.randn(1, 8)
    probs = process(logits, [p])
    gen = make_generator(p, "cpu")
    draws = torch.multinomial(probs[0], 200_000, replacement=True, generator=gen)
    tv = 0.5 * (torch.bincount(draws, minlength=8) / 200_000 - probs[0]).abs().sum().item()
    assert tv < TV_TOL


def test_sample_draws_what_multinomial_draws():
    """`sample` is torch.multinomial's one-sample path without its host-syncing check: the same token from the same
    generator state, stream position after it included, for every seed; so it follows the distribution too."""
    p = SamplingParams(temperature=0.9, top_p=0.95, seed=5)
    probs = process(torch.randn(3, 37, generator=torch.Generator().manual_seed(1)), [p] * 3)
    for seed in range(50):
        mine, ref = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        got = sample(probs, [p] * 3, [mine] * 3)
        want = [torch.multinomial(probs[r], 1, generator=ref)[0] for r in range(3)]
        assert got.tolist() == [int(w) for w in want]
        assert torch.rand(1, generator=mine).item() == torch.rand(1, generator=ref).item()
    gen = torch.Generator().manual_seed(0)
    draws = torch.stack([sample(probs[:1], [p], [gen]) for _ in range(20_000)]).flatten()
    tv = 0.5 * (torch.bincount(draws, minlength=37) / 20_000 - probs[0]).abs().sum().item()
    assert tv < 0.03


def test_softmax_rows_is_softmax():
    """The grid-wide softmax `_truncate` uses: torch.softmax's values (to float32 rounding) on rows with banned
    (-inf) tokens and a wide range, each row summing to 1; a row of -inf is nan, as torch.softmax leaves it."""
    from ninfer_rt.sampling import softmax_rows
    x = torch.randn(5, 1001, generator=torch.Generator().manual_seed(2)) * 30
    x[1, ::3] = -math.inf
    x[4] = -math.inf
    got, want = softmax_rows(x.clone()), torch.softmax(x, dim=-1)
    assert torch.allclose(got[:4], want[:4], rtol=1e-5, atol=1e-8)
    assert torch.allclose(got[:4].sum(-1), torch.ones(4)) and (got[1, ::3] == 0).all()
    assert got[4].isnan().all() and want[4].isnan().all()


@pytest.mark.parametrize("ks", [(20, 5, 1), (20, 0, 3)], ids=["all-top-k", "one-row-without"])
def test_truncation_from_a_top_k_selection_equals_the_sort(monkeypatch, ks):
    """Rows whose top_k are all small are truncated from `topk(max k)`, not a sort of the vocabulary: the same
    distributions (top-k, then top-p and min-p inside it) as the full sort gives."""
    import ninfer_rt.sampling as S
    params = [SamplingParams(temperature=0.9, top_k=k, top_p=tp, min_p=mp, seed=1)
              for k, tp, mp in zip(ks, (0.9, 1.0, 0.5), (0.0, 0.02, 0.0))]
    x = torch.randn(3, 3001, generator=torch.Generator().manual_seed(4)) * 4
    got = process(x, params)
    monkeypatch.setattr(S, "TOPK_SORT_MAX", 0)          # always the full sort
    monkeypatch.setattr(S.sampling_rows, "TOPK_GRAPH_WIDTH", 0)
    want = process(x, params)
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-9)
    assert [int((r > 0).sum()) <= (k or 3001) for r, k in zip(got, ks)] == [True] * 3


@pytest.mark.parametrize("rows,vocab,width,chunk", [(1, 5003, 64, 512), (3, 1001, 20, 97), (2, 300, 64, 16)],
                         ids=["one-row", "odd-chunks", "chunk-below-width"])
def test_chunked_selection_is_topk(rows, vocab, width, chunk):
    """`select_top` by chunks: torch.topk's sorted values, and columns that hold them."""
    from ninfer_rt.sampling_rows import select_top
    probs = torch.rand(rows, vocab, generator=torch.Generator().manual_seed(vocab))
    probs[0, :200] = 0.0                                          # zero probabilities rank above the padding
    got, cols = select_top(probs, width, chunk)
    assert torch.equal(got, probs.topk(width)[0]) and torch.equal(probs.gather(1, cols), got)


def test_sample_mixed_batch_is_row_by_row():
    """A batch mixing greedy and sampled rows: one race for all (greedy rows against ones), the same tokens as
    each row alone (its argmax, or multinomial's draw from its generator) and the same stream positions."""
    rows = [SamplingParams(temperature=0), SamplingParams(temperature=0.8, seed=1), SamplingParams(temperature=0),
            SamplingParams(temperature=1.2, top_k=5, seed=2)]
    probs = process(torch.randn(4, 41, generator=torch.Generator().manual_seed(3)), rows)
    for seed in range(30):
        mine = [None if p.greedy else torch.Generator().manual_seed(seed + i) for i, p in enumerate(rows)]
        ref = [None if p.greedy else torch.Generator().manual_seed(seed + i) for i, p in enumerate(rows)]
        got = sample(probs, rows, mine).tolist()
        want = [int(probs[r].argmax()) if p.greedy else int(torch.multinomial(probs[r], 1, generator=ref[r])[0])
                for r, p in enumerate(rows)]
        assert got == want
        assert all(m is None or torch.equal(m.get_state(), f.get_state()) for m, f in zip(mine, ref))


def test_seed_reproducibility():
    p = SamplingParams(temperature=1.0, seed=1234)
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0))
    probs = process(logits, [p])

    def run(params):
        gen = make_generator(params, "cpu")
        return [sample(probs, [params], [gen]).item() for _ in range(40)]

    assert run(p) == run(p)
    assert run(p) != run(SamplingParams(temperature=1.0, seed=1235))


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.1), ("temperature", float("nan")), ("top_k", -2), ("top_k", 2.5),
    ("top_p", 0.0), ("top_p", 1.5), ("min_p", -0.1), ("min_p", 1.01), ("presence_penalty", 2.5),
    ("frequency_penalty", float("inf")), ("seed", -1), ("seed", "7"), ("max_tokens", 0),
    ("max_tokens", True), ("stop_token_ids", [-1]), ("stop_token_ids", "12"), ("stop", [""]),
    ("stop", [3]), ("ignore_eos", 1),
], ids=lambda v: str(v))
def test_invalid_params_name_the_field(field, value):
    with pytest.raises(SamplingError, match=field):
        SamplingParams(**{field: value})


def test_params_normalise_sequences():
    p = SamplingParams(stop="##", stop_token_ids=[3, 4], top_k=-1)
    assert p.stop == ("##",) and p.stop_token_ids == (3, 4) and p.top_k == 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 2.0


# ---- acceptance rules ------------------------------------------------------------------------------

def test_greedy_verify_prefix_and_bonus():
    target = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8]])
    drafts = torch.tensor([[5, 6, 7], [5, 9, 7], [1, 6, 7]])
    n, tok = greedy_verify(target, drafts)
    assert n.tolist() == [3, 1, 0] and tok.tolist() == [8, 6, 5]
    n, tok = greedy_verify(torch.tensor([[4]]), torch.zeros(1, 0, dtype=torch.long))
    assert n.tolist() == [0] and tok.tolist() == [4]


def _random_dist(g, *shape, zeros=0):
    w = torch.rand(*shape, generator=g) ** 3
    if zeros:
        w[..., :zeros] = 0                     # some tokens impossible under this distribution
    return w / w.sum(-1, keepdim=True)


@pytest.mark.parametrize("case", ["dense", "disjoint_support", "onehot_drafts"])
def test_rejection_sampling_preserves_target_distribution(case):
    """200k seeded rounds (K=2, V=7): every emitted position follows the target distribution."""
    V, K, N = 7, 2, 200_000
    g = torch.Generator().manual_seed(11)
    p0 = _random_dist(g, V)
    p1 = _random_dist(g, V, V)                 # p1 depends on the first token: table [x1] -> dist
    p2 = _random_dist(g, V)
    q = _random_dist(g, K, V, zeros=2 if case == "disjoint_support" else 0)
    if case == "onehot_drafts":    # each draft on its position's likeliest token: both are accepted often
        d0 = int(p0.argmax())
        q = torch.nn.functional.one_hot(torch.tensor([d0, int(p1[d0].argmax())]), V).float()
    drafts = torch.stack([torch.multinomial(q[i], N, replacement=True, generator=g) for i in range(K)], 1)
    p = torch.stack([p0.expand(N, V), p1[drafts[:, 0]], p2.expand(N, V)], 1)
    u = torch.rand(N, K, generator=g)
    noise = torch.empty(N, V).exponential_(generator=g)
    n_acc, tok = rejection_verify(p, q.expand(N, K, V), drafts, u, noise)
    first = torch.where(n_acc >= 1, drafts[:, 0], tok)
    _assert_tv(first, p0, "position 0")
    # conditional on x1 being an accepted draft, the next emitted token follows p1[x1]
    checked = 0
    for x1 in range(V):
        sel = (n_acc >= 1) & (drafts[:, 0] == x1)
        if sel.sum() > 20_000:
            second = torch.where(n_acc[sel] >= 2, drafts[sel, 1], tok[sel])
            _assert_tv(second, p1[x1], f"position 1 | x1={x1}", tol=0.02)
            checked += 1
    assert checked >= 1, "no accepted first token was frequent enough to check position 1"
    # both drafts accepted: the bonus token follows the last position's target
    bonus = n_acc == K
    assert bonus.sum() > 10_000, int(bonus.sum())
    _assert_tv(tok[bonus], p2, "bonus token", tol=0.02)
    accept_rate = (n_acc >= 1).float().mean().item()
    assert accept_rate == pytest.approx(torch.minimum(p0, q[0]).sum().item(), abs=0.01)


def _assert_tv(tokens, target, what, tol=TV_TOL):
    emp = torch.bincount(tokens, minlength=target.numel()).float() / tokens.numel()
    tv = 0.5 * (emp - target).abs().sum().item()
    assert tv < tol, f"{what}: total variation {tv:.4f} >= {tol}"


def test_rejection_equals_greedy_for_onehot_distributions():
    """Greedy p and argmax drafts: rejection sampling reduces to the longest-prefix rule."""
    g = torch.Generator().manual_seed(2)
    B, K, V = 64, 4, 9
    tgt = torch.randint(0, 3, (B, K + 1), generator=g)
    drafts = torch.randint(0, 3, (B, K), generator=g)
    p = torch.nn.functional.one_hot(tgt, V).float()
    q = torch.nn.functional.one_hot(drafts, V).float()
    n_r, t_r = rejection_verify(p, q, drafts, torch.rand(B, K, generator=g),
                                torch.empty(B, V).exponential_(generator=g))
    n_g, t_g = greedy_verify(tgt, drafts)
    assert torch.equal(n_r, n_g) and torch.equal(t_r, t_g)


def test_rejection_without_drafts_samples_the_target():
    """K = 0 (plain decode / fallback step): the token is a draw from p_0."""
    V, N = 5, 200_000
    g = torch.Generator().manual_seed(4)
    p0 = _random_dist(g, V)
    n, tok = rejection_verify(p0.expand(N, 1, V), torch.zeros(N, 0, V), torch.zeros(N, 0, dtype=torch.long),
                              torch.zeros(N, 0), torch.empty(N, V).exponential_(generator=g))
    assert (n == 0).all()
    _assert_tv(tok, p0, "K=0")
