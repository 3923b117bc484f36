"""bench/prefix_cache.py on CPU: the tiny synthetic artifact through the real Engine with and without the prefix
cache; its records, the resumed cases' cached tokens, and one-line argument errors."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.append(str(Path(__file__).resolve().parents[1] / "bench"))     # last: bench/ must not shadow anything
import prefix_cache as bench  # noqa: E402

KEYS = {"kind", "recipe", "gpu", "backend", "graphs", "entries", "prompt_tokens", "case", "cached_tokens",
        "ttft_ms", "off_ms", "tail_ms", "speedup", "ratio_to_tail", "token_match", "prefill_graphs"}
pytestmark = pytest.mark.usefixtures("one_thread")


def test_cpu_dry_run(tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = bench.main(["--tiny", "--device", "cpu", "--prompt-lens", "48", "--system", "24", "--reps", "1",
                     "--dir", str(tmp_path / "a"), "--out", str(out)])
    assert rc == 0
    recs = json.loads(out.read_text())
    assert [r["case"] for r in recs] == ["cold", "repeat", "shared"]
    for r in recs:
        assert set(r) == KEYS and r["kind"] == "prefix_cache" and r["prompt_tokens"] == 48 and r["ttft_ms"] > 0
        assert r["speedup"] == pytest.approx(r["off_ms"] / r["ttft_ms"])
        assert r["token_match"] == 1.0                  # fp32 on the CPU: the cache changes no token
    cold, repeat, shared = recs
    assert cold["cached_tokens"] == 0 and cold["tail_ms"] is None and cold["ratio_to_tail"] is None
    assert repeat["cached_tokens"] == 32 and shared["cached_tokens"] == 16     # pages of 16 below 47 / 24 tokens
    assert repeat["tail_ms"] > 0 and shared["ratio_to_tail"] > 0
    assert "repeat" in capsys.readouterr().out


def test_a_prompt_no_longer_than_the_system_prompt_is_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--tiny", "--device", "cpu", "--prompt-lens", "30", "--system", "24"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--prompt-lens: each must exceed --system" in err and "Traceback" not in err
