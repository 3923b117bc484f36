"""The README's main job (`python -m ninfer_pack.demo`): one real end-to-end run on the embedded tiny model
(pack TP2 nvfp4 -> verify -> inspect -> generate with MTP), plus its failure reporting and options."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ninfer_pack import demo

DEMO_MAX_NEW = 8          # tokens generated in CI; the README run uses 64
DEMO_TIMEOUT_S = 300      # a hang must fail the test, not the whole CI job


def _run_demo(args, env_extra=None):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "ninfer_pack.demo", *args], capture_output=True, text=True,
                          env=env, timeout=DEMO_TIMEOUT_S, check=False)


def test_demo_end_to_end(tmp_path):
    out = tmp_path / "demo"
    out.mkdir()
    stale = out / "generate_stats.json"
    stale.write_text(json.dumps({"drafted": -1}))          # a previous run's leftovers must not be reported
    p = _run_demo([str(out), "--json"], {demo.MAX_NEW_ENV: str(DEMO_MAX_NEW)})
    assert p.returncode == 0, p.stderr[-3000:]
    assert "Traceback" not in p.stderr
    s = json.loads(p.stdout)
    # the narration shows the real commands, in order
    log = p.stderr
    pack, rt = demo.show(demo.tool("ninfer-pack", "ninfer_pack.cli")), demo.show(demo.tool("ninfer-rt", "ninfer_rt.cli"))
    marks = [f"{pack} convert", "--tp 2 --recipe nvfp4 --force", f"{pack} verify", f"{pack} inspect",
             f"{rt} generate", f"--spec mtp --draft-tokens 3 --max-new {DEMO_MAX_NEW} --temperature 0"]
    pos = [log.find(m) for m in marks]
    assert all(i >= 0 for i in pos), dict(zip(marks, pos))
    assert pos == sorted(pos)
    assert "rank 0 of 2" in log                              # the inspect excerpt
    files = [Path(f).name for f in s["files"]]
    assert files == ["model.tp2-rank0.ninfer", "model.tp2-rank1.ninfer"]
    st = json.loads(stale.read_text())
    assert st == s["stats"]
    assert st["draft_tokens"] == 3 and st["prompt_tokens"] > 0
    assert 1 <= st["generated_tokens"] <= DEMO_MAX_NEW
    assert st["generated_tokens"] == DEMO_MAX_NEW or st["finish_reason"] == "stop"
    assert st["spec_rounds"] >= 1 and st["drafted"] >= st["spec_rounds"]
    assert 0 <= st["accepted"] <= st["drafted"]
    per = st["acceptance_per_position"]
    assert 1 <= len(per) <= 3 and all(0.0 <= a <= 1.0 for a in per)
    assert 1.0 <= st["tokens_per_round"] <= 4.0
    assert s["completion"].strip(), "the model produced no text"
    assert "tokens/round (ceiling 4)" in log


def test_failed_step_is_named(tmp_path):
    bad = tmp_path / "not-a-checkpoint"
    bad.mkdir()
    p = _run_demo([str(tmp_path / "out"), "--source", str(bad)])
    assert p.returncode == 1
    assert "Traceback" not in p.stderr
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("error: demo: step 1/4 (pack not-a-checkpoint"), last
    assert "error:" in p.stderr.split(last)[0], "the tool's own error line is shown above the summary"
    assert "[2/4]" not in p.stdout                            # nothing runs after the failing step


@pytest.mark.parametrize("field,value", [("max_new", 0), ("draft_tokens", -1), ("tp", True), ("max_new", 2.5)],
                         ids=["max_new-zero", "draft-negative", "tp-bool", "max_new-float"])
def test_options_rejected(tmp_path, field, value):
    with pytest.raises(demo.DemoError, match=field):
        demo.DemoOptions(tmp_path, **{field: value})


def test_bad_env_max_new(tmp_path):
    p = _run_demo([str(tmp_path)], {demo.MAX_NEW_ENV: "lots"})
    assert p.returncode == 1
    assert p.stderr.strip() == f"error: demo: {demo.MAX_NEW_ENV}: expected an integer, got 'lots'"


@pytest.mark.parametrize("arg", ["def fibonacci(n):\n", "a b", "it's\t'quoted'\\n", "$HOME `x`"],
                         ids=["newline", "space", "quotes-tab-backslash", "shell-meta"])
def test_printed_command_is_pasteable(arg):
    # what the demo prints must give the same argv when pasted into bash
    p = subprocess.run(["bash", "-c", "printf '%s\\0' " + demo.show(["x", arg])], capture_output=True,
                       check=True)
    assert p.stdout.decode().split("\0")[:-1] == ["x", arg]


def test_embedded_checkpoint_is_found():
    d = demo.tiny_checkpoint()
    assert json.loads((d / "config.json").read_text())["model_type"] == "qwen3_5_text"
    assert (d / "tokenizer.json").is_file() and list(d.glob("*.safetensors"))
