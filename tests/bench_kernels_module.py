"""bench/kernels.py loaded as a module for tests (shared by the tests of its runoff and its precompile)."""
import importlib.util
import os
import sys
from pathlib import Path


def load_bench_kernels(name: str):
    """bench/kernels.py as module `name` (not `kernels`: transformers probes for HF's package of that name),
    without keeping the NINFER_GEMV_TUNE=force it sets for its own runs."""
    bench = Path(__file__).resolve().parents[1] / "bench"
    if str(bench) not in sys.path:
        sys.path.append(str(bench))           # its sibling modules (bench_device, ...)
    before = os.environ.get("NINFER_GEMV_TUNE")
    spec = importlib.util.spec_from_file_location(name, bench / "kernels.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    if before is None:
        os.environ.pop("NINFER_GEMV_TUNE", None)
    else:
        os.environ["NINFER_GEMV_TUNE"] = before
    return mod
