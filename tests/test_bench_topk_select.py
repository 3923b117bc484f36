"""bench/topk_select.py on the CPU (its dry run): every case timed, the chunked and bf16-logits selections' values
equal torch.topk's, the record fields other tools read."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.append(str(Path(__file__).resolve().parents[1] / "bench"))     # last: bench/ must not shadow anything
import topk_select  # noqa: E402

KEYS = {"kind", "case", "rows", "vocab", "width", "chunk", "us", "copy_us", "in_copies", "same", "gpu", "device"}


def test_cpu_dry_run(tmp_path, capsys):
    out = tmp_path / "t.json"
    assert topk_select.main(["--device", "cpu", "--vocab", "3001", "--rows", "1,3", "--chunks", "256,700",
                             "--reps", "2", "--out", str(out)]) == 0
    recs = json.loads(out.read_text())
    assert [(r["case"], r["rows"], r["chunk"]) for r in recs][:5] == [
        ("topk", 1, 0), ("chunked", 1, 256), ("chunked", 1, 700), ("bf16_logits", 1, 0), ("processed", 1, 0)]
    assert len(recs) == 12 and all(set(r) == KEYS and r["us"] > 0 and r["same"] for r in recs)
    assert "chunked" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--rows", "0"], ["--chunks", "x"]], ids=["rows", "chunks"])
def test_bad_arguments(argv, capsys):
    with pytest.raises(SystemExit) as e:
        topk_select.main(argv + ["--device", "cpu"])
    assert e.value.code == 2 and capsys.readouterr().err.startswith("error: ")
