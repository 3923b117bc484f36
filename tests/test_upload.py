"""`ninfer-pack upload`: verification first, the dry run, and the exact calls made into huggingface_hub."""
import shutil

import huggingface_hub
import pytest
from click.testing import CliRunner

from hf_tiny import make_tiny_checkpoint
from ninfer_pack import upload as upload_mod
from ninfer_pack.cli import main
from ninfer_pack.convert import convert


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    src = make_tiny_checkpoint(tmp_path_factory.mktemp("src"), seed=3)
    out = tmp_path_factory.mktemp("art") / "out"
    convert(str(src), out, recipe="bf16", tp=2, jobs=1, progress=False, base_model="Qwen/Qwen3.8-27B")
    return out


class FakeApi:
    calls: list = []
    fail: Exception | None = None

    def __init__(self, *a, **kw):
        FakeApi.calls.append(("init", a, kw))

    def create_repo(self, repo_id, **kw):
        FakeApi.calls.append(("create_repo", repo_id, kw))
        if FakeApi.fail:
            raise FakeApi.fail

    def create_branch(self, repo_id, **kw):
        FakeApi.calls.append(("create_branch", repo_id, kw))

    def upload_folder(self, **kw):
        FakeApi.calls.append(("upload_folder", kw))
        return type("CommitInfo", (), {"commit_url": f"https://huggingface.co/{kw['repo_id']}/commit/abc"})()


@pytest.fixture
def fake_api(monkeypatch):
    FakeApi.calls, FakeApi.fail = [], None
    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    return FakeApi


def _run(*args):
    return CliRunner().invoke(main, ["upload", *map(str, args)])


def test_dry_run_lists_files_and_card(artifact, fake_api):
    res = _run(artifact, "me/tiny-ninfer", "--dry-run")
    assert res.exit_code == 0, res.output
    out = res.stdout
    for name in ("model.tp2-rank0.ninfer", "model.tp2-rank1.ninfer", "README.md", "report.json"):
        size = (artifact / name).stat().st_size
        assert f"{size:>16}  {name}" in out
    assert "base_model: \"Qwen/Qwen3.8-27B\"" in out and "base_model_relation: quantized" in out
    assert fake_api.calls == []                                   # nothing touched the Hub


@pytest.mark.parametrize("private,revision", [(False, None), (True, "tp2-bf16")], ids=["public-main", "private-branch"])
def test_upload_calls(artifact, fake_api, private, revision):
    args = ["--private"] * private + (["--revision", revision] if revision else [])
    res = _run(artifact, "me/tiny-ninfer", *args)
    assert res.exit_code == 0, res.output
    assert res.stdout.strip() == "https://huggingface.co/me/tiny-ninfer/commit/abc"
    names = [c[0] for c in fake_api.calls]
    assert names == ["init", "create_repo"] + ["create_branch"] * bool(revision) + ["upload_folder"]
    assert fake_api.calls[1] == ("create_repo", "me/tiny-ninfer", {"repo_type": "model", "private": private,
                                                                    "exist_ok": True})
    up = fake_api.calls[-1][1]
    assert up["folder_path"] == str(artifact) and up["revision"] == revision and up["repo_id"] == "me/tiny-ninfer"
    assert up["allow_patterns"] == ["model.tp2-rank0.ninfer", "model.tp2-rank1.ninfer", "README.md", "report.json"]


def test_corrupt_artifact_is_not_uploaded(artifact, fake_api, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(artifact, bad)
    f = bad / "model.tp2-rank1.ninfer"
    b = bytearray(f.read_bytes())
    b[-300] ^= 0xFF                                  # inside the payload: a checksum must catch it
    f.write_bytes(bytes(b))
    res = _run(bad, "me/tiny-ninfer")
    assert res.exit_code == 1
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "rank1" in lines[0]
    assert fake_api.calls == []


def test_unfinished_or_bad_inputs(artifact, fake_api, tmp_path, monkeypatch):
    part = tmp_path / "part"
    shutil.copytree(artifact, part)
    (part / ".ninfer-pack.json").write_text("{}")
    cases = [((part, "me/x"), "unfinished conversion"), ((artifact, "not-a-repo"), "not a Hub repo id"),
             ((tmp_path / "none", "me/x"), "not a folder")]
    for args, msg in cases:
        res = _run(*args)
        assert res.exit_code == 2 and res.stderr.startswith("error: ") and msg in res.stderr, res.output
    monkeypatch.setattr(upload_mod, "HUB_MAX_FILE_BYTES", 1000)
    res = _run(artifact, "me/x", "--dry-run")
    assert res.exit_code == 2 and "over the Hub's 50 GB per-file limit" in res.stderr


@pytest.mark.parametrize("text,msg", [("{torn", "report.json: not valid JSON"),
                                      ('{"artifact_id": "0123"}', "report.json: artifact_id '0123' does not match"),
                                      ("[1]", "report.json: artifact_id 'None' does not match")],
                         ids=["torn", "stale", "not-an-object"])
def test_bad_report_is_not_uploaded(artifact, fake_api, tmp_path, text, msg):
    bad = tmp_path / "bad"
    shutil.copytree(artifact, bad)
    (bad / "report.json").write_text(text)
    res = _run(bad, "me/x")
    lines = res.stderr.strip().splitlines()
    assert res.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and msg in lines[0], lines
    assert fake_api.calls == []


def test_hub_failure_is_one_line(artifact, fake_api):
    fake_api.fail = RuntimeError("401 Client Error: Unauthorized\nmore detail")
    res = _run(artifact, "me/tiny-ninfer")
    assert res.exit_code == 2
    log, err = res.stderr.strip().splitlines()          # the verification log line, then the error
    assert log.startswith("verified artifact ")
    assert err == "error: me/tiny-ninfer: upload failed: 401 Client Error: Unauthorized"


def test_renamed_stem_is_not_uploaded(artifact, fake_api, tmp_path):
    """other.tp2-rank0 next to model.tp2-rank1: every checksum holds, but the runtime cannot load the set."""
    bad = tmp_path / "bad"
    shutil.copytree(artifact, bad)
    (bad / "model.tp2-rank0.ninfer").rename(bad / "other.tp2-rank0.ninfer")
    res = _run(bad, "me/tiny-ninfer")
    assert res.exit_code == 1
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "other.tp2-rank0.ninfer" in lines[0] and "model.tp2-rank0.ninfer" in lines[0]
    assert fake_api.calls == []
