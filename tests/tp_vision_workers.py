"""Rank program for the TP image test in tests/test_vision_engine.py. Spawned ranks import this module, so it
must not import transformers (hf_tiny)."""
from __future__ import annotations

from ninfer_rt.backends.torch_ops import TorchOps
from ninfer_rt.engine import Engine, cache_config
from ninfer_rt.engine_follower import Follower
from ninfer_rt.loader import load
from ninfer_rt.sampling import SamplingParams
from ninfer_rt.speculative import SpecConfig
from ninfer_rt.vision.setup import VisionOptions, build_vision_runtime

MAX_BATCH, KV_PAGES, CHUNK = 2, 32, 7
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def vision_rank_program(group, path, image_ids, image_uris, text_ids, k):
    """Rank 0: an image request and a text request through the engine (MTP K=k); others follow.
    -> (tokens per request, whether a follower ever bound the tower) on rank 0."""
    loaded = load(path, rank=group.rank, tp_size=group.size)
    ops, spec = TorchOps(), SpecConfig(num_draft_tokens=k)
    if group.rank != 0:
        Follower(loaded, ops, group, spec, cache_config(loaded.config, MAX_BATCH, KV_PAGES)).run()
        assert not any(n.startswith("visual.") for n in loaded.weights)      # the tower lives on rank 0 only
        return None
    vis = build_vision_runtime(loaded, ops, VisionOptions())
    eng = Engine(loaded, ops, group, spec, max_batch=MAX_BATCH, kv_pages=KV_PAGES, prefill_chunk=CHUNK, vision=vis)
    vr = vis.preprocess_request(image_ids, vis.load_images(image_uris))
    eng.add_request("img", image_ids, GREEDY, vision=vr)
    eng.add_request("txt", text_ids, GREEDY)
    out = {"img": [], "txt": []}
    while eng.has_work():
        for o in eng.step():
            out[o.req_id] += o.new_token_ids
    eng.shutdown()
    return out
