"""Run a bench/ script's --smoke mode (CPU + Triton interpreter) in a subprocess and read the records it wrote."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def bench_smoke(script: str, tmp_path: Path, *args: str) -> tuple[list, str]:
    """(records of bench/`script` --smoke `args` --out <tmp>, its stdout); the script must exit 0."""
    out = tmp_path / f"{Path(script).stem}.json"
    p = subprocess.run([sys.executable, str(BENCH / script), "--smoke", *args, "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(out.read_text()), p.stdout
