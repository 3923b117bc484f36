"""Session-wide test setup: without a GPU, Triton kernels run under the interpreter.

TRITON_INTERPRET must be set before any kernel module is imported (triton.jit reads it at decoration
time), so it is set here, ahead of every test module, rather than in individual files.
"""
import os
import sys

import pytest
import torch

# `python -m pytest` from the repository root puts the root first on sys.path, where `kernels/` (installed as
# ninfer_kernels) shadows Hugging Face's `kernels` package, which transformers (5.25) requires and imports at
# once. The root stays importable (tests import `bench.*`), but after site-packages.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _ROOT] + [_ROOT]

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # flash-linear-attention, when importable on a CPU box, makes transformers route GDN to Triton
    # kernels that cannot run here; block it so the torch reference path is used.
    sys.modules.setdefault("fla", None)
    sys.modules.setdefault("causal_conv1d", None)


@pytest.fixture(scope="module")
def lm_head_drafts():
    """MTP drafts from the main lm_head (NINFER_DRAFT_HEAD=lm_head) for tests whose oracle computes them that way:
    the default, auto, drafts from an NVFP4 copy of it wherever the hidden size splits into 16-blocks, and TP ranks
    each scale their own slice of that copy."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NINFER_DRAFT_HEAD", "lm_head")
        yield


@pytest.fixture(scope="module")
def one_thread():
    """Tiny matmuls and multi-process TP tests: extra intra-op threads only add contention on 2 CI cores."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
