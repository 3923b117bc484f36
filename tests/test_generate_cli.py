"""`ninfer-rt generate` end to end on a tiny artifact made by the packer; one-line errors on bad input."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner
from hf_tiny import build_hf_model, make_tiny_artifact, make_tiny_checkpoint

from ninfer_rt.cli import main
from container_util import flip_tensor_bit

STATS_KEYS = {"load_s", "prefill_tok_s", "decode_tok_s", "drafted", "accepted", "acceptance_per_position",
              "tokens_per_round"}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    from ninfer_pack.convert import convert
    base = tmp_path_factory.mktemp("gen")
    make_tiny_checkpoint(base / "hf", seed=3)
    convert(str(base / "hf"), base / "art", recipe="bf16", tp=1, jobs=1, progress=False)
    return base / "art"


def cli(*args):
    res = CliRunner().invoke(main, ["generate", *map(str, args)])
    assert not isinstance(res.exception, Exception) or isinstance(res.exception, SystemExit), res.exception
    return res


def test_generate_with_mtp_matches_plain_greedy_and_writes_stats(packed, tmp_path):
    common = ["--raw", "The quick brown fox", "--max-new", "16", "--temperature", "0"]
    plain = cli(packed, *common)
    assert plain.exit_code == 0, plain.stderr
    stats = tmp_path / "stats.json"
    spec = cli(packed, *common, "--spec", "mtp", "--draft-tokens", "3", "--stats-json", stats)
    assert spec.exit_code == 0, spec.stderr
    assert spec.stdout == plain.stdout and spec.stdout.endswith("\n")
    s = json.loads(stats.read_text())
    assert STATS_KEYS <= set(s)
    assert s["generated_tokens"] == 16 and s["drafted"] > 0 and len(s["acceptance_per_position"]) == 3
    assert s["tokens_per_round"] >= 1.0 and s["load_s"] > 0 and s["decode_tok_s"] > 0
    assert "mtp K=3: accepted" in spec.stderr and "tok/s" in spec.stderr
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".stats")]       # temp file renamed away
    umask = os.umask(0)
    os.umask(umask)
    assert stats.stat().st_mode & 0o777 == 0o666 & ~umask      # an ordinary file, not mkstemp's 0600


@pytest.mark.parametrize("head", ["nvfp4", "nvfp4:100"])
def test_generate_with_a_draft_head_matches_plain_greedy(packed, tmp_path, monkeypatch, head):
    """--draft-head hands the choice to the model build (through NINFER_DRAFT_HEAD, restored after the test); the
    verify step keeps the lm_head, so the text is plain greedy's."""
    monkeypatch.setenv("NINFER_DRAFT_HEAD", "lm_head")
    common = ["--raw", "The quick brown fox", "--max-new", "12", "--temperature", "0"]
    plain = cli(packed, *common)
    stats = tmp_path / "stats.json"
    spec = cli(packed, *common, "--spec", "mtp", "--draft-head", head, "--stats-json", stats)
    assert spec.exit_code == 0, spec.stderr
    assert spec.stdout == plain.stdout
    assert os.environ["NINFER_DRAFT_HEAD"] == head and json.loads(stats.read_text())["drafted"] > 0


def test_chat_prompt_messages_and_sampling_seed(packed, tmp_path):
    msgs = tmp_path / "m.json"
    msgs.write_text(json.dumps([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]))
    args = ["--max-new", "8", "--temperature", "0.9", "--top-k", "20", "--seed", "3", "--spec", "mtp",
            "--draft-tokens", "2"]
    a, b = cli(packed, "--messages", msgs, *args), cli(packed, "--messages", msgs, *args)
    assert a.exit_code == 0 and a.stdout == b.stdout
    assert cli(packed, "--prompt", "hi", "--no-think", "--max-new", "4").exit_code == 0


def test_generate_subprocess_end_to_end(packed, tmp_path):
    """The installed entry point as a user runs it (fresh process, real stdout/stderr)."""
    stats = tmp_path / "s.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    entry = "import sys; from ninfer_rt.cli import main; sys.exit(main())"     # what the ninfer-rt script runs
    p = subprocess.run([sys.executable, "-c", entry, "generate", str(packed), "--prompt", "hello",
                        "--max-new", "6", "--spec", "mtp", "--draft-tokens", "2", "--temperature", "0",
                        "--stats-json", str(stats)], capture_output=True, text=True, env=env, timeout=300,
                       check=False)
    assert p.returncode == 0, p.stderr
    assert json.loads(stats.read_text())["generated_tokens"] == 6




@pytest.fixture(scope="module")
def bad_artifacts(tmp_path_factory, packed):
    base = tmp_path_factory.mktemp("bad")
    corrupt = base / "corrupt"
    corrupt.mkdir()
    (src,) = [packed / f for f in os.listdir(packed) if f.endswith(".ninfer")]
    (corrupt / src.name).write_bytes(src.read_bytes())
    flip_tensor_bit(corrupt / src.name, "layers.1.mlp.down_proj.weight", byte=5, mask=0x20)
    # config of one model, tensors of another (hidden 96 instead of 64)
    from hf_tiny import artifact_tensors
    other = build_hf_model(seed=1, hidden=96)
    make_tiny_artifact(base / "other", build_hf_model(seed=1), ranks=artifact_tensors(other))
    make_tiny_artifact(base / "nomtp", build_hf_model(seed=1, mtp=False))
    return {"corrupt": corrupt, "other": base / "other", "nomtp": base / "nomtp"}


@pytest.mark.parametrize("case,args,message", [
    ("corrupt", ["--raw", "x"], r"layers\.1\.mlp\.down_proj\.weight: checksum mismatch"),
    ("other", ["--raw", "x"], r"embed_tokens\.weight"),
    ("nomtp", ["--raw", "x", "--spec", "mtp"], r"MTP"),
    ("packed", ["--raw", "y" * 600], r"prompt has 600 tokens.*512"),
    ("packed", [], r"exactly one of --prompt, --messages, --raw"),
    ("packed", ["--raw", "x", "--prompt", "y"], r"exactly one of"),
    ("packed", ["--raw", ""], r"--raw: empty text"),
    ("packed", ["--raw", "x", "--spec", "mtp", "--draft-tokens", "9"], r"^error: --draft-tokens: .*1\.\.7, got 9$"),
    ("packed", ["--raw", "x", "--draft-tokens", "9"], r"^error: --draft-tokens: "),
    ("packed", ["--raw", "x", "--spec", "mtp", "--draft-head", "q4"],
     r"^error: --draft-head='q4': expected auto, lm_head, nvfp4 or nvfp4:N with N a positive integer$"),
    ("packed", ["--raw", "x", "--top-p", "0"], r"top_p"),
    ("packed", ["--messages", "MISSING"], r"missing\.json: No such file"),
    ("packed", ["--messages", "BADJSON"], r"not valid JSON"),
    ("packed", ["--messages", "TEXTPART"], r"messages\.0\.content\.1\.text: expected a string"),
    ("packed", ["--messages", "NUMPART"], r"messages\.0\.content\.0: expected an object with 'type'"),
    ("missing", ["--raw", "x"], r"no such file or folder"),
    # argv bytes that are not UTF-8 reach Python as surrogate escapes (os.fsdecode)
    ("packed", ["--raw", "\udcff\udcfe"], r"^error: --raw: not valid UTF-8 \(byte 0xff"),
    ("packed", ["--prompt", "a\udcff"], r"^error: --prompt: not valid UTF-8 \(byte 0xff at character 1\)"),
    ("packed", ["--messages", "SURROGATE"], r"surrogate\.json: messages\.0\.content: .*lone surrogate U\+D800"),
    ("packed", ["--raw", "x", "--max-context", "31"], r"^error: --max-context: expected at least 32 tokens"),
    ("packed", ["--raw", "x", "--stats-json", "NOPARENT"],
     r"^error: --stats-json .*nope.s\.json: parent folder .* does not exist"),
    ("packed", ["--raw", "x", "--stats-json", "FILEPARENT"],
     r"^error: --stats-json .*: parent folder .* is not a directory"),
], ids=["corrupt-tensor", "other-model", "no-mtp", "overlong-prompt", "no-prompt", "two-prompts", "empty-raw", "bad-k",
        "bad-k-without-spec", "bad-draft-head", "bad-top-p", "missing-messages", "bad-messages", "text-part-not-string",
        "part-not-object", "missing-artifact", "raw-not-utf8", "prompt-not-utf8", "messages-lone-surrogate",
        "max-context-under-two-pages", "stats-json-no-folder", "stats-json-folder-is-a-file"])
def test_bad_input_is_one_line_error(packed, bad_artifacts, tmp_path, case, args, message):
    import re
    art = {"packed": packed, "missing": tmp_path / "nope", **bad_artifacts}[case]
    files = {"BADJSON": "[{", "MISSING": None,
             "TEXTPART": json.dumps([{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                  {"type": "text", "text": 5}]}]),
             "NUMPART": json.dumps([{"role": "user", "content": [7]}]),
             "SURROGATE": '[{"role": "user", "content": "hi \\ud800 there"}]'}
    for name, text in files.items():
        if text is not None:
            (tmp_path / f"{name.lower()}.json").write_text(text)
    (tmp_path / "afile").write_text("")
    paths = {"NOPARENT": tmp_path / "nope" / "s.json", "FILEPARENT": tmp_path / "afile" / "s.json"}
    args = [str(tmp_path / f"{a.lower()}.json") if a in files else str(paths.get(a, a)) for a in args]
    res = cli(art, *args)
    assert res.exit_code == 2, (res.exit_code, res.stderr)
    errors = [ln for ln in res.stderr.strip().splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and res.stderr.strip().endswith(errors[0]), res.stderr     # logs may precede it
    assert re.search(message, errors[0]), errors[0]
    assert "Traceback" not in res.stderr and res.stdout == ""
    if case == "packed" and "prompt has" not in message:     # caught before the (slow) load
        assert "KV pool" not in res.stderr, res.stderr
    assert not (tmp_path / "nope").exists()                  # --stats-json never creates folders


def test_tp2_generate_matches_tp1_and_reports_a_bad_follower_shard(tmp_path):
    """The real multi-process CLI path: same text as TP1; a corrupted rank-1 shard is reported once by rank 0."""
    tiny = build_hf_model(seed=2)
    make_tiny_artifact(tmp_path / "tp1", tiny)
    make_tiny_artifact(tmp_path / "tp2", tiny, tp=2)
    args = ["--raw", "abc", "--max-new", "8", "--temperature", "0", "--spec", "mtp", "--draft-tokens", "2"]
    one, two = cli(tmp_path / "tp1", *args), cli(tmp_path / "tp2", *args, "--tp", "2")
    assert one.exit_code == 0 and two.exit_code == 0, two.stderr
    assert two.stdout == one.stdout
    flip_tensor_bit(tmp_path / "tp2" / "model.tp2-rank1.ninfer", "layers.0.mlp.up_proj.weight", byte=5, mask=0x20)
    bad = cli(tmp_path / "tp2", *args, "--tp", "2")
    assert bad.exit_code == 2
    assert bad.stderr.strip().splitlines()[-1].startswith("error: rank 1: ")
    assert "layers.0.mlp.up_proj.weight: checksum mismatch" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.parametrize("key,value", [("temperature", "hot"), ("top_k", None), ("top_p", [0.9]), ("min_p", True),
                                       ("repetition_penalty", "x")],
                         ids=["temperature-str", "top-k-null", "top-p-list", "min-p-bool", "repetition-str"])
def test_bad_generation_config_values_are_one_line_errors(key, value):
    from ninfer_rt.cmd_generate import GenerateError, GenerateOptions, sampling_params
    opts = GenerateOptions(artifact="a", raw="x")
    good = sampling_params(opts, {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95}, (7,))
    assert (good.temperature, good.top_k, good.top_p, good.min_p, good.stop_token_ids) == (0.6, 20, 0.95, 0.0, (7,))
    with pytest.raises(GenerateError, match=f"generation_config.json: {key}: expected a number"):
        sampling_params(opts, {"do_sample": True, key: value}, ())
    flag = {"temperature": 0.5, "top_k": 3, "top_p": 0.5, "min_p": 0.1, "repetition_penalty": 1.2}[key]   # a flag wins
    assert getattr(sampling_params(GenerateOptions(artifact="a", raw="x", **{key: flag}),
                                   {"do_sample": True, key: value}, ()), key) == flag


def test_repetition_penalty_comes_from_generation_config_greedy_or_not():
    """HF's generate applies generation_config's repetition_penalty whether or not it samples."""
    from ninfer_rt.cmd_generate import GenerateOptions, sampling_params
    opts = GenerateOptions(artifact="a", raw="x")
    assert sampling_params(opts, {"repetition_penalty": 1.05}, ()).repetition_penalty == 1.05
    assert sampling_params(opts, {}, ()).repetition_penalty == 1.0
    assert sampling_params(GenerateOptions(artifact="a", raw="x", repetition_penalty=1.3),
                           {"repetition_penalty": 1.05}, ()).repetition_penalty == 1.3


def _template_resources(**changes) -> dict:
    from hf_tiny import tiny_resources
    res = tiny_resources()
    tcfg = json.loads(res["tokenizer_config.json"])
    if "tc" in changes:                          # tokenizer_config.json's chat_template, no .jinja file
        del res["chat_template.jinja"]
        res["tokenizer_config.json"] = json.dumps({**tcfg, "chat_template": changes["tc"]}).encode()
    if "jinja" in changes:
        res["chat_template.jinja"] = changes["jinja"]
    return res


@pytest.mark.parametrize("change,message", [
    ({"tc": ["oops"]}, r"^error: resource tokenizer_config\.json: chat_template: expected a string or a list"),
    ({"tc": 5}, r"^error: resource tokenizer_config\.json: chat_template: expected .* got int 5$"),
    ({"jinja": b"\xff\xfe{{ x }}"}, r"^error: resource chat_template\.jinja: not valid UTF-8"),
    ({"jinja": b"{{ 1/0 }}"}, r"^error: resource chat_template\.jinja: rendering failed: ZeroDivisionError"),
], ids=["list-of-strings", "number", "not-utf8", "raises-at-render"])
def test_broken_chat_template_fails_chat_prompts_only(tmp_path, change, message):
    import re
    make_tiny_artifact(tmp_path / "art", build_hf_model(seed=1), resources=_template_resources(**change))
    res = cli(tmp_path / "art", "--prompt", "hi", "--max-new", "2")
    assert res.exit_code == 2 and "Traceback" not in res.stderr, res.stderr
    errors = [ln for ln in res.stderr.strip().splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and re.search(message, errors[0]), res.stderr
    raw = cli(tmp_path / "art", "--raw", "hi", "--max-new", "2")      # a raw prompt needs no template
    assert raw.exit_code == 0 and raw.stdout, raw.stderr


def test_tp2_rank_file_that_is_a_folder_is_named(tmp_path):
    make_tiny_artifact(tmp_path, build_hf_model(seed=1), tp=2)
    rank1 = tmp_path / "model.tp2-rank1.ninfer"
    rank1.unlink()
    rank1.mkdir()
    res = cli(tmp_path, "--raw", "x", "--tp", "2", "--max-new", "2")
    assert res.exit_code == 2 and "Traceback" not in res.stderr, res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert last == f"error: {rank1}: is a directory, expected a .ninfer rank file", res.stderr


@pytest.mark.parametrize("flag", ["--regex", "--json-schema", "--json-schema-file", "--grammar-file"])
def test_generate_constrained_output(packed, tmp_path, flag):
    """llama-cli's --json-schema / --grammar-file, and --regex: the text follows it (MTP on, greedy)."""
    pytest.importorskip("xgrammar")
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    (tmp_path / "s.json").write_text(json.dumps(schema))
    (tmp_path / "g.ebnf").write_text('root ::= "yes" | "no"')
    arg = {"--regex": ["--regex", "[0-9]{3}"], "--json-schema": ["--json-schema", json.dumps(schema)],
           "--json-schema-file": ["--json-schema", f"@{tmp_path / 's.json'}"],
           "--grammar-file": ["--grammar-file", tmp_path / "g.ebnf"]}[flag]
    res = cli(packed, "--raw", "Answer:", "--max-new", "120", "--temperature", "0", "--spec", "mtp", *arg)
    assert res.exit_code == 0, res.stderr
    text = res.stdout.rstrip("\n")
    if flag == "--regex":
        assert len(text) == 3 and text.isdigit()
    elif flag == "--grammar-file":
        assert text in ("yes", "no")
    else:
        assert json.loads(text).keys() == {"ok"}
    assert "finish stop" in res.stderr


@pytest.mark.parametrize("args,message", [
    (["--regex", "a", "--json-schema", "{}"], "error: --regex: cannot be combined with --json-schema"),
    (["--json-schema", "{oops"], "error: --json-schema: not JSON"),
    (["--json-schema", "@/nonexistent.json"], "error: --json-schema /nonexistent.json: cannot read"),
    (["--regex", ""], "error: --regex: empty"),
    (["--regex", "[unclosed"], "error: --regex: regex: cannot be compiled: Regex parsing error"),
], ids=["two", "not-json", "missing-file", "empty", "bad-regex"])
def test_constrained_flag_errors(packed, args, message):
    res = cli(packed, "--raw", "x", *args)
    assert res.exit_code != 0 and message in res.stderr and "Traceback" not in res.stderr
