"""Prefix caching (ninfer_rt/prefix_cache.py): a prompt that starts like a cached one resumes at the cached
page boundary with the shared KV pages and a copy of the GDN state; greedy output equals the engine without the
cache, with and without MTP, sequential and concurrent, under eviction; pages are reference-counted and none
leaks."""
from __future__ import annotations

import pytest
import torch
from hf_tiny import build_hf_model, loaded_model

from ninfer_rt.backends.torch_ops import TorchOps
from ninfer_rt.engine import Engine
from ninfer_rt.prefix_cache import PrefixCache, page_hashes
from ninfer_rt.sampling import SamplingParams
from ninfer_rt.speculative import SpecConfig
from ninfer_rt.state import GdnPool, KVPool, SeqState

pytestmark = pytest.mark.usefixtures("one_thread")
PAGE, NEW = 4, 7
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
BASE = [(7 * i + 3) % 250 for i in range(23)]           # cut at 20: the entry holds tokens [0, 20]


@pytest.fixture(scope="module")
def loaded():
    return loaded_model(build_hf_model(seed=11))


def engine(loaded, k: int, prefix: int, **kw) -> Engine:
    return Engine(loaded, TorchOps(), spec=SpecConfig(num_draft_tokens=k) if k else None, page_size=PAGE,
                  prefix_cache=prefix, prefill_chunk=kw.pop("chunk", 64), **kw)


def run(eng: Engine, batches: list[list[list[int]]]) -> list[list[int]]:
    """Each batch's prompts added together, run to the end, then the next batch."""
    outs, n = [], 0
    for prompts in batches:
        ids = [f"r{n + i}" for i in range(len(prompts))]
        n += len(prompts)
        got = {i: [] for i in ids}
        for rid, p in zip(ids, prompts):
            eng.add_request(rid, p, GREEDY)
        while eng.has_work():
            for o in eng.step():
                got[o.req_id] += o.new_token_ids
        outs += [got[i] for i in ids]
    return outs


def later(prefix_len: int, tail: list[int]) -> list[int]:
    return BASE[:prefix_len] + tail


@pytest.mark.parametrize("k", [0, 3], ids=["plain", "mtp-3"])
def test_resumed_prompts_equal_the_uncached_engine(loaded, k):
    batches = [[BASE], [later(21, [9, 8, 7, 6, 5])], [later(22, [1])], [list(BASE)], [later(17, [4, 4, 4])]]
    want = run(engine(loaded, k, 0), batches)
    eng = engine(loaded, k, 4)
    got = run(eng, batches)
    assert got == want
    st = eng.prefix.stats
    # BASE and the two prompts sharing its tokens [0, 20] resume at 20; the last one shares 17 tokens only
    assert st.hits == 3 * 20 and st.queries == sum(len(b[0]) for b in batches)
    assert eng.model.kv_pool.free_pages() == eng.cache.num_pages and eng.model.gdn_pool.free_slots() == \
        eng.cache.max_seqs


def test_resumed_prompts_through_the_graph_runner(loaded):
    """The CUDA-graph runner's static-buffer steps (eager here): resumed sequences decode and verify alike."""
    from test_engine_graphs import eager_graphs
    batches = [[BASE], [later(21, [9, 8, 7, 6, 5]), later(22, [3])]]
    want = run(engine(loaded, 2, 0), batches)
    eng = engine(loaded, 2, 4, graphs=eager_graphs(2), max_batch=2)
    assert run(eng, batches) == want and eng.graphs.stats.eager_steps > 0 and eng.prefix.stats.hits == 40


def test_a_prompt_differing_at_the_entry_token_does_not_resume(loaded):
    """The MTP row n-1 pairs token n: a prompt sharing tokens [0, 20) but not token 20 starts from scratch."""
    eng = engine(loaded, 2, 4)
    run(eng, [[BASE], [later(20, [251, 3, 3])]])
    assert eng.prefix.stats.hits == 0


@pytest.mark.parametrize("k", [0, 2], ids=["plain", "mtp-2"])
def test_a_shared_start_is_cached_where_prompts_part(loaded, k):
    """Prompts that share a start and then differ (a system prompt): the second one's prefill also stops at the
    last page boundary of the shared part, so the third resumes there; outputs equal the uncached engine's."""
    batches = [[BASE], [later(18, [200, 201, 202, 203, 204])], [later(17, [9, 9, 9, 9, 9, 9])]]
    want = run(engine(loaded, k, 0), batches)
    eng = engine(loaded, k, 4)
    assert run(eng, batches) == want
    assert sorted(e.length for e in eng.prefix.entries.values()) == [16, 20, 20, 20]     # + each own cut
    assert eng.prefix.stats.hits == 16


def test_concurrent_sharers_and_the_cut_chunk(loaded):
    """Two requests resume from one entry while both run (the pages are held three times); a prompt's chunk
    ends at its entry point when it would pass it."""
    eng = engine(loaded, 2, 4, chunk=8)
    first = run(eng, [[BASE]])
    assert eng.stats.steps > 0 and len(eng.prefix.entries) == 1
    (entry,) = eng.prefix.entries.values()
    pool = eng.model.kv_pool
    eng.add_request("a", later(21, [5, 6]), GREEDY)
    eng.add_request("b", later(21, [7, 8, 9]), GREEDY)
    eng.step()
    assert [pool.refs[p] for p in entry.pages] == [3] * 5
    while eng.has_work():
        eng.step()
    assert [pool.refs[p] for p in entry.pages] == [1] * 5
    want = run(engine(loaded, 2, 0, chunk=8), [[BASE], [later(21, [5, 6]), later(21, [7, 8, 9])]])
    assert first == want[:1]


def test_eviction_frees_pages_for_new_requests(loaded):
    """A pool too small for the cache's pages and a new request: allocation evicts the least recently used
    entries; outputs stay those of the uncached engine and nothing leaks."""
    prompts = [[(t + 17 * j) % 250 for t in BASE] for j in range(4)]
    batches = [[p] for p in prompts] + [[later(21, [2, 2])]]
    want = run(engine(loaded, 0, 0, kv_pages=16, max_batch=1), batches)
    eng = engine(loaded, 0, 8, kv_pages=16, max_batch=1)
    assert run(eng, batches) == want
    pool = eng.model.kv_pool
    assert eng.prefix.stats.evictions > 0 and pool.free_pages() == pool.num_pages
    assert eng.prefix.evictable() == sum(pool.refs[p] == n for p, n in eng.prefix.held.items())
    eng.prefix.clear()
    assert pool.unused() == pool.num_pages and not any(pool.refs) and not eng.prefix.held


def test_prompts_parting_at_a_page_boundary_resume_one_page_earlier(loaded):
    """Prompts that share 16 tokens (four whole pages) and differ at token 16: an entry at 16 would need token 16
    to match, so the second prompt's prefill stops at 12 and the third resumes there."""
    system = BASE[:16]
    batches = [[system + [100 + j] * 6] for j in range(4)]
    want = run(engine(loaded, 2, 0), batches)
    eng = engine(loaded, 2, 8)
    assert run(eng, batches) == want
    assert eng.prefix.stats.hits == 2 * 12


def _kept(kv, gdn, cache, prompt) -> None:
    """An entry for `prompt` as a finished prefill leaves it (its sequence then freed)."""
    s = SeqState(kv, gdn, False)
    n = cache.cut(prompt)
    s.ensure_capacity(n)
    s.length = n
    cache.insert(s, prompt, cache.hashes(prompt), n)
    s.free()


def test_reclaim_keeps_entries_that_running_sequences_hold():
    """Pages an entry shares with a running sequence free nothing when the entry goes: under pressure the
    entries that do free pages go first, whatever their age."""
    kv, gdn = KVPool(8, 2, 1, 1, 2, torch.float32, "cpu"), GdnPool(3, 1, 1, 2, 1, 2, 2, "cpu")
    cache = PrefixCache(kv, gdn, 4)
    shared, other = [1, 2, 3, 4, 5], [6, 7, 8, 9, 10]
    _kept(kv, gdn, cache, shared)
    user = SeqState(kv, gdn, False)
    assert cache.resume(user, shared + [11], cache.hashes(shared + [11])) == 4
    _kept(kv, gdn, cache, other)
    assert kv.free_pages() == 6 and cache.evictable() == 2          # the other entry's two pages
    kv.alloc(6)
    assert [e.tokens for e in cache.entries.values()] == [tuple(shared)] and cache.evictable() == 0


def test_max_entries_bounds_the_cache(loaded):
    eng = engine(loaded, 0, 2)
    run(eng, [[[(t + j) % 250 for t in BASE]] for j in range(3)])
    assert len(eng.prefix.entries) == 2 and eng.prefix.stats.evictions == 1


def test_short_prompts_and_prompt_logprobs_skip_the_cache(loaded):
    eng = engine(loaded, 0, 4)
    run(eng, [[BASE[:4]]])                                   # cut 0: no entry
    assert not eng.prefix.entries
    run(eng, [[BASE]])
    eng.add_request("lp", later(21, [1]), SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0))
    while eng.has_work():
        eng.step()
    assert eng.prefix.stats.hits == 0                        # every prompt row's logits are needed


def test_pool_reference_counts():
    pool = KVPool(6, 2, 1, 1, 2, torch.float32, "cpu")
    a = pool.alloc(3)
    pool.share(a[:2])
    pool.release(a)
    assert pool.unused() == 4 and [pool.refs[p] for p in a] == [1, 1, 0]
    pool.release(a[:2])
    assert pool.unused() == 6
    with pytest.raises(RuntimeError, match="released more often"):
        pool.release(a[:1])


def test_page_hashes_chain():
    h = page_hashes([1, 2, 3, 4, 5, 6], 2, 3)
    assert len(set(h)) == 3 and page_hashes([1, 2, 3, 4, 9, 9], 2, 3)[:2] == h[:2]
    assert page_hashes([9, 2, 3, 4], 2, 2)[1] != h[1]         # a change in an earlier page changes the later ones


def test_bad_entry_count():
    pool = KVPool(4, 2, 1, 1, 2, torch.float32, "cpu")
    with pytest.raises(ValueError, match="positive number of entries"):
        PrefixCache(pool, None, 0)


def test_reset_empties_the_cache_at_the_next_step(loaded):
    """vLLM's reset_prefix_cache: asked between steps (any thread), done before the next step's admissions; pages
    running sequences share stay theirs."""
    eng = engine(loaded, 2, 4)
    run(eng, [[BASE]])
    eng.add_request("a", later(21, [5, 6]), GREEDY)
    eng.step()                                       # resumed from the entry: its pages are shared now
    assert eng.reset_prefix_cache() and len(eng.prefix.entries) == 1
    eng.add_request("b", later(21, [7]), GREEDY)
    while eng.has_work():
        eng.step()
    assert eng.prefix.stats.hits == 20                # "a" only: "b" was admitted after the reset
    pool = eng.model.kv_pool
    assert pool.free_pages() == pool.num_pages
    assert not engine(loaded, 0, 0).reset_prefix_cache()


def test_a_reset_asked_while_a_step_is_planned_is_not_lost(loaded, monkeypatch):
    """The server asks from its event-loop thread: an ask landing while _schedule builds its plan is done at the
    next one."""
    import ninfer_rt.engine as E
    eng = engine(loaded, 0, 4)
    run(eng, [[BASE]])
    real, asked = E.Plan, []

    def plan_asking(*a, **kw):
        if not asked:
            asked.append(eng.reset_prefix_cache())
        return real(*a, **kw)
    monkeypatch.setattr(E, "Plan", plan_asking)
    eng.add_request("a", later(21, [5]), GREEDY)
    eng.step()                                       # planned before the ask: resumes from the entry
    eng.add_request("b", later(21, [6]), GREEDY)
    while eng.has_work():
        eng.step()
    assert asked == [True] and eng.prefix.stats.hits == 20      # "b" was admitted after the reset
