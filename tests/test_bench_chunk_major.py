"""bench/chunk_major.py on CPU (Triton interpreter, one tiny shape): the chunk-major copy gives the production h2 and
MMA kernels' output exactly, and the records carry their fields."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU check of the script; on a GPU the benchmark itself runs")
def test_bench_chunk_major_smoke(tmp_path):
    out = tmp_path / "cm.json"
    script = Path(__file__).resolve().parents[1] / "bench" / "chunk_major.py"
    p = subprocess.run([sys.executable, str(script), "--smoke", "--T", "1", "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]       # non-zero also when the two layouts' outputs differ
    recs = json.loads(out.read_text())
    for rec in recs:
        for k in ("name", "shape", "T", "config", "us_row", "us_chunk", "pct_copy_bw_row", "pct_copy_bw_chunk",
                  "max_abs_diff", "copy_tbps", "gpu"):
            assert k in rec, k
        assert rec["max_abs_diff"] == 0.0
    # T=1: the packed-half2 and the warp-MMA kernel (T >= 2: the warp-MMA one, the same code)
    assert [(r["T"], "h2=True" in r["config"]) for r in recs] == [(1, True), (1, False)]
    assert "tiny" in p.stdout
