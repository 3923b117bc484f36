"""A small synthetic bf16 artifact run by the Triton backend in fp32 (the interpreter on CPU, the kernels on a GPU):
for tests of a step's pieces against the model's own forward. Import after bench/ is on sys.path."""
from __future__ import annotations

import dataclasses

import synth_artifact as synth
import torch

from ninfer_rt.loader import load
from ninfer_rt.model import Model
from ninfer_rt.state import CacheConfig

SMALL = {"hidden": 64, "intermediate": 128, "heads": 4, "kv_heads": 2, "head_dim": 16, "gdn_k_heads": 2,
         "gdn_v_heads": 4, "gdn_head_dim": 16, "vocab": 256}


def model_factory(folder: str, num_pages: int, max_seqs: int):
    """-> (a function making a fresh fp32 Triton Model of the small artifact, its device)."""
    from ninfer_rt.backends.triton_ops import TritonOps
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    paths, _ = synth.build(folder, dataclasses.replace(synth.TINY, **SMALL), "bf16", workers=1)

    def model() -> Model:
        lm = load(paths[0], device=dev, dtype=torch.float32)
        return Model(lm.config, lm.weights, TritonOps(), cache=CacheConfig(num_pages=num_pages, page_size=8,
                                                                          max_seqs=max_seqs),
                     dtype=torch.float32, consume_weights=True)
    return model, dev
