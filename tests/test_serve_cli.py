"""`ninfer-rt serve` as a command: a real process that serves then drains on SIGTERM, one-line CLI errors,
and `hf://` artifacts downloaded and verified before use (tiny fp32 artifact from tests/test_server.py)."""
from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from test_server import CTX, MODEL_ID, tiny_artifact


def _start_cli(args: list[str]):
    import subprocess
    import sys
    proc = subprocess.Popen([sys.executable, "-c", "from ninfer_rt.cli import main; main()", "serve", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if "listening on http" in line:        # http:// or https://
            return proc, line.split("://")[1].split()[0], lines
    proc.wait(10)
    raise AssertionError("server did not start: " + "".join(lines))


def wait_healthy(url: str, proc, timeout: float = 60) -> None:
    """Poll /health until 200; fail if the process exits or the deadline passes."""
    deadline = time.monotonic() + timeout
    while httpx.get(url + "/health").status_code != 200:
        assert time.monotonic() < deadline and proc.poll() is None, "server did not become healthy"
        time.sleep(0.1)


def test_cli_serves_then_drains_on_sigterm(tmp_path_factory):
    import signal
    art = tiny_artifact(tmp_path_factory)
    proc, addr, _ = _start_cli([art, "--port", "0", "--device", "cpu", "--max-context", str(CTX),
                                "--model-id", MODEL_ID, "--no-verify", "--drain-timeout", "60"])
    url = f"http://{addr}"
    try:
        wait_healthy(url, proc)
        body = {"model": MODEL_ID, "prompt": "drain me", "max_tokens": 40, "temperature": 0, "stream": True,
                "ignore_eos": True, "stream_options": {"include_usage": True}}
        events = []
        with httpx.Client(base_url=url, timeout=60) as h, h.stream("POST", "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if not line.startswith("data:"):
                    continue
                events.append(line[6:])
                if len(events) == 2:
                    proc.send_signal(signal.SIGTERM)
                    refused_by = time.monotonic() + 10           # no new connections while draining
                    while True:
                        try:
                            httpx.get(url + "/health", timeout=2)
                        except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError):
                            break        # refused, or accepted by the kernel backlog and closed (or reset) unanswered
                        assert time.monotonic() < refused_by, "still accepting connections after SIGTERM"
                        time.sleep(0.05)
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["usage"]["completion_tokens"] == 40     # ran to the end
        assert proc.wait(60) == 0
        assert "stopped" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _cli(args):
    from click.testing import CliRunner

    from ninfer_rt.cli import main
    return CliRunner().invoke(main, ["serve", *args])


def parsed(monkeypatch, args):
    """The ServeOptions `serve ARGS` (on the CPU) would run the server with; the server is not started."""
    import ninfer_rt.server.serve as S
    got = []
    monkeypatch.setattr(S, "run_server", lambda opts: got.append(opts) or 0)
    res = _cli(["--device", "cpu", *args])
    assert res.exit_code == 0, res.output
    return got[0]


@pytest.mark.parametrize("args,needle", [
    (["/definitely/not/here"], "no such file or folder"),
    (["{art}", "--kv-capacity", "lots"], "expected a number of tokens or 'auto'"),
    (["{art}", "--port", "{busy}"], "cannot bind"),
    (["{art}", "--max-context", "100000", "--port", "0", "--device", "cpu"], "at most 512 positions"),
    (["hf://not-a-repo"], "expected hf://ORG/REPO"),
    # the KV pool needs two 16-token pages: refused at parsing, not after the load with a misleading hint
    (["{art}", "--kv-capacity", "31", "--port", "{busy}"], "'--kv-capacity': expected at least 32 tokens"),
    (["{art}", "--max-context", "31", "--port", "{busy}"],
     "'--max-context' / '--max-model-len': 31 is not in the range x>=32"),
    (["{art}", "--spec", "mtp", "--draft-head", "nvfp4:0", "--port", "{busy}"],
     "--draft-head='nvfp4:0': expected auto, lm_head, nvfp4 or nvfp4:N"),
], ids=["missing-artifact", "bad-kv-capacity", "port-in-use", "context-over-model", "bad-hf-spec",
        "kv-capacity-under-two-pages", "max-context-under-two-pages", "bad-draft-head"])
def test_cli_errors_are_one_line(tmp_path_factory, args, needle):
    art = tiny_artifact(tmp_path_factory)
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    try:
        res = _cli([a.format(art=art, busy=busy.getsockname()[1]) for a in args])
    finally:
        busy.close()
    assert res.exit_code == 2, res.output
    assert needle in res.output and "Traceback" not in res.output
    assert sum(line.startswith(("error:", "Error:")) for line in res.output.splitlines()) == 1


TEMPLATE = "{% for m in messages %}CUSTOM {{ m.role }}: {{ m.content }}\n{% endfor %}"


def _self_signed(folder) -> tuple[str, str]:
    """A throwaway key and self-signed certificate for 127.0.0.1 (PEM files)."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now)
            .not_valid_after(now + datetime.timedelta(days=1)).sign(key, hashes.SHA256()))
    kp, cp = folder / "key.pem", folder / "cert.pem"
    kp.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                     serialization.NoEncryption()))
    cp.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(kp), str(cp)


@pytest.mark.parametrize("args,names", [
    (["art", "--served-model-name", "a", "b", "--port", "1"], ("a", ("b",))),
    (["art", "--served-model-name", "a", "--model-id", "b", "a"], ("a", ("b", "a"))),
    (["art", "--served-model-name=a"], ("a", ())),
    (["--served-model-name", "a", "--", "art"], ("a", ())),
    (["art"], (None, ())),
], ids=["vllm-list", "repeated", "equals", "dashdash", "none"])
def test_served_model_names_parse_like_vllm(monkeypatch, args, names):
    """vLLM's `--served-model-name a b` (names up to the next option), repeated flags, `=`; replies use the first."""
    opts = parsed(monkeypatch, args)
    assert (opts.model_id, opts.aliases) == names and opts.runtime.artifact == "art"


@pytest.mark.parametrize("flags,want", [
    (["--tensor-parallel-size", "2", "--max-num-seqs", "3", "--max-model-len", "64", "--enforce-eager",
      "--max-num-batched-tokens", "128"],
     dict(tp=2, max_concurrency=3, max_context=64, eager=True, prefill_chunk=128, draft_tokens=0)),
    (["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 2}'], dict(draft_tokens=2)),
    (["--speculative-config", '{"method": "qwen3_next_mtp", "num_speculative_tokens": 5}'], dict(draft_tokens=5)),
], ids=["vllm-names", "speculative-config", "speculative-config-next"])
def test_vllm_flag_names(monkeypatch, flags, want):
    rt = parsed(monkeypatch, ["art", *flags]).runtime
    assert {k: getattr(rt, k) for k in want} == want


@pytest.mark.parametrize("flags,want", [([], "fcfs"), (["--scheduling-policy", "priority"], "priority")],
                         ids=["default", "priority"])
def test_scheduling_policy_reaches_the_server(monkeypatch, flags, want):
    assert parsed(monkeypatch, ["art", *flags]).scheduling_policy == want


def test_scheduling_policy_is_checked():
    res = _cli(["art", "--scheduling-policy", "lifo"])
    assert res.exit_code == 2 and "'lifo' is not one of 'fcfs', 'priority'" in res.output


@pytest.mark.parametrize("value,needle", [
    ("3", "expected a JSON object"),
    ('{"method": "eagle", "num_speculative_tokens": 2}', "method 'eagle': only the model's own MTP"),
    ('{"method": "mtp", "num_speculative_tokens": 9}', "num_speculative_tokens: expected an integer in 1..7"),
    ('{"method": "mtp", "num_speculative_tokens": 2, "model": "x"}', "'model' is not supported"),
], ids=["not-json-object", "method", "count", "extra-key"])
def test_bad_speculative_config_is_one_line(value, needle):
    res = _cli(["--device", "cpu", "art", "--speculative-config", value])
    assert res.exit_code == 2 and needle in res.output and "Traceback" not in res.output


def test_empty_served_model_name_is_one_line(tmp_path_factory):
    res = _cli([tiny_artifact(tmp_path_factory), "--served-model-name", "a", " ", "--device", "cpu"])
    assert res.exit_code == 2 and "--served-model-name: a name must not be empty" in res.output
    assert "Traceback" not in res.output


def test_cli_https_chat_template_and_served_model_name(tmp_path_factory, tmp_path):
    art = tiny_artifact(tmp_path_factory)
    key, cert = _self_signed(tmp_path)
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    proc, addr, lines = _start_cli([art, "--port", "0", "--device", "cpu", "--max-context", str(CTX), "--no-verify",
                                    "--served-model-name", "my-model", "alias", "--chat-template", str(tmp_path / "t.jinja"),
                                    "--ssl-keyfile", key, "--ssl-certfile", cert])
    url = f"https://{addr}"
    try:
        assert "listening on https://" in lines[-1]
        deadline = time.monotonic() + 60
        while httpx.get(url + "/health", verify=False).status_code != 200:
            assert time.monotonic() < deadline and proc.poll() is None, "server did not become healthy"
            time.sleep(0.1)
        assert [m["id"] for m in httpx.get(url + "/v1/models", verify=False).json()["data"]] == ["my-model", "alias"]
        assert httpx.get(url + "/v1/models/alias", verify=False).json()["id"] == "alias"
        ids = httpx.post(url + "/tokenize", verify=False, json={"messages": [{"role": "user", "content": "hi"}],
                                                              "model": "alias", "add_generation_prompt": False}
                         ).json()["tokens"]
        assert httpx.post(url + "/tokenize", verify=False, json={"prompt": "hi", "model": "x"}).status_code == 404
        text = httpx.post(url + "/detokenize", verify=False, json={"tokens": ids}).json()["prompt"]
        assert text == "CUSTOM user: hi\n"
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("flags,needle", [
    (["--ssl-keyfile", "{key}"], "give both"),
    (["--ssl-keyfile", "/no/key.pem", "--ssl-certfile", "{cert}"], "--ssl-keyfile /no/key.pem: no such file"),
    (["--ssl-keyfile", "{cert}", "--ssl-certfile", "{cert}"], "cannot use them"),
    (["--chat-template", "/no/t.jinja"], "--chat-template /no/t.jinja: cannot read it"),
    (["--chat-template", "{broken}"], "--chat-template {broken}: "),
], ids=["key-alone", "missing-key", "not-a-key", "missing-template", "broken-template"])
def test_cli_tls_and_template_errors_are_one_line(tmp_path_factory, tmp_path, flags, needle):
    art = tiny_artifact(tmp_path_factory)
    key, cert = _self_signed(tmp_path)
    (tmp_path / "broken.jinja").write_text("{% for m in messages %}")
    names = {"key": key, "cert": cert, "broken": str(tmp_path / "broken.jinja")}
    res = _cli([art, "--port", "0", "--device", "cpu", *[f.format(**names) for f in flags]])
    assert res.exit_code == 2, res.output
    assert needle.format(**names) in res.output and "Traceback" not in res.output
    assert sum(line.startswith(("error:", "Error:")) for line in res.output.splitlines()) == 1


def _copy_artifact(art: str, dst) -> str:
    import shutil
    shutil.copytree(art, dst)
    return str(dst)


def test_hf_artifact_is_downloaded_and_verified(tmp_path_factory, tmp_path, monkeypatch):
    import huggingface_hub

    from ninfer_rt.server.runtime import ServeError, default_model_id, resolve_artifact
    art = tiny_artifact(tmp_path_factory)
    good, bad = _copy_artifact(art, tmp_path / "good"), _copy_artifact(art, tmp_path / "bad")
    rank = next(p for p in (tmp_path / "bad").iterdir() if p.suffix == ".ninfer")
    data = bytearray(rank.read_bytes())
    data[-100] ^= 0xFF                                  # inside the last tensor's payload
    rank.write_bytes(bytes(data))
    seen = {}

    def fake(repo_id, revision=None, **kw):
        seen.update(repo_id=repo_id, revision=revision)
        return good if repo_id == "org/good" else bad
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    assert resolve_artifact("hf://org/good@v1") == (good, True) and seen == {"repo_id": "org/good", "revision": "v1"}
    assert default_model_id("hf://org/good@v1") == "org/good"
    with pytest.raises(ServeError, match="failed verification"):
        resolve_artifact("hf://org/bad")
    res = _cli(["hf://org/bad", "--port", "0", "--device", "cpu"])      # the loader fails -> server stops
    assert res.exit_code == 2 and "failed verification" in res.output, res.output


@pytest.mark.parametrize("util,free_gib", [(None, 1), (1.0, 1), (0.75, 4), (0.95, 0.8)],
                         ids=["default", "all", "three-quarters", "at-least-the-default"])
def test_gpu_memory_utilization_leaves_the_rest_free(monkeypatch, util, free_gib):
    """vLLM's --gpu-memory-utilization u: the automatic KV size leaves (1 - u) of the device free (at least
    the default 1 GiB of headroom)."""
    import dataclasses
    import sys
    from pathlib import Path

    import torch
    sys.path.append(str(Path(__file__).resolve().parents[1] / "bench"))     # last: bench/ must not shadow anything
    import synth_artifact as synth

    from ninfer_rt.server.runtime import RuntimeOptions, auto_kv_tokens, kv_bytes_per_token
    cfg = synth.TINY.config()
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (8 << 30, 16 << 30))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    opts = RuntimeOptions(artifact="x", device="cuda", dtype="bfloat16", gpu_memory_utilization=util)
    base = auto_kv_tokens(cfg, dataclasses.replace(opts, gpu_memory_utilization=None), torch.device("cuda"))
    got = auto_kv_tokens(cfg, opts, torch.device("cuda"))
    per = kv_bytes_per_token(cfg, 1, torch.bfloat16)
    assert base - got in (int((max(free_gib, 1) - 1) * (1 << 30)) // per, int((max(free_gib, 1) - 1) * (1 << 30)) // per + 1)


def test_auto_kv_size_keeps_the_repack_growth_free(monkeypatch):
    """The load-time repacks run at warm-up, after the pool is sized: the bytes they will add (the IQ3_S code
    planes, `Ops.repack_growth`) come off the automatic KV size."""
    import sys
    from pathlib import Path

    import torch
    sys.path.append(str(Path(__file__).resolve().parents[1] / "bench"))
    import synth_artifact as synth

    from ninfer_rt.server.runtime import RuntimeOptions, auto_kv_tokens, kv_bytes_per_token
    cfg = synth.TINY.config()
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (8 << 30, 16 << 30))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    opts = RuntimeOptions(artifact="x", device="cuda", dtype="bfloat16")
    per = kv_bytes_per_token(cfg, 1, torch.bfloat16)
    base = auto_kv_tokens(cfg, opts, torch.device("cuda"))
    assert base - auto_kv_tokens(cfg, opts, torch.device("cuda"), growth=1000 * per) in (1000, 1001)


@pytest.mark.parametrize("kw,why", [({"gpu_memory_utilization": 0.0}, "expected a fraction in (0, 1], got 0.0"),
                                    ({"gpu_memory_utilization": 1.5}, "expected a fraction in (0, 1], got 1.5"),
                                    ({"gpu_memory_utilization": 0.9, "kv_capacity": 4096}, "give one of them")],
                         ids=["zero", "over-one", "with-kv-capacity"])
def test_gpu_memory_utilization_is_checked(kw, why):
    from ninfer_rt.server.runtime import RuntimeOptions, ServeError
    import re
    with pytest.raises(ServeError, match=re.escape(why)):
        RuntimeOptions(artifact="x", **kw)


def test_gpu_memory_utilization_reaches_the_runtime(monkeypatch):
    assert parsed(monkeypatch, ["art", "--gpu-memory-utilization", "0.8"]).runtime.gpu_memory_utilization == 0.8
    assert parsed(monkeypatch, ["art"]).runtime.gpu_memory_utilization is None
    res = _cli(["art", "--gpu-memory-utilization", "0"])
    assert res.exit_code == 2 and "--gpu-memory-utilization" in res.output and "Traceback" not in res.output
