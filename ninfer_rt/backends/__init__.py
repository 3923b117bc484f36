"""Ops backends. `get_ops("torch")` is the CPU/GPU reference; `get_ops("triton")` the GPU kernels."""
from __future__ import annotations

import importlib

from ninfer_formats.errors import LoadError

from ..ops import Ops

_BACKENDS = {"torch": ("ninfer_rt.backends.torch_ops", "TorchOps"),
             "triton": ("ninfer_rt.backends.triton_ops", "TritonOps")}


def get_ops(name: str = "torch") -> Ops:
    if name not in _BACKENDS:
        raise LoadError(f"--backend: unknown ops backend {name!r} (choose from {', '.join(_BACKENDS)})")
    module, cls = _BACKENDS[name]
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module:
            raise
        raise LoadError(f"--backend: the {name} backend is not available in this build") from None
    return getattr(mod, cls)()
