"""`ninfer-rt serve --vision`: image chat requests through the OpenAI client against a tiny random VL artifact.

An image+text request (data URIs) gives the greedy text of the Engine driven directly with the same images
(the server runs MTP K=2, the reference none: lossless with images too; a TP2 server the same); without
--vision the tower stays in the file and an image is a 400 naming the flag; bad images (not an image, bad
base64, too many, too large, over the image-token budget, http and local-file URLs) are 400s with OpenAI
error bodies and the server keeps serving; /metrics and the request log count image tokens.
"""
from __future__ import annotations

import base64
import io
import json
import re

import httpx
import numpy as np
import pytest
from hf_tiny import artifact_tensors, build_hf_model, model_config_from_hf, tiny_resources
from PIL import Image
from test_server import MODEL_ID, _post, expected_text, metric, real_runtime, real_server, wait_idle

from ninfer_formats.container import write_artifact

PRE = {"size": {"shortest_edge": 16 * 16, "longest_edge": 32 * 32}, "patch_size": 4, "temporal_patch_size": 2,
       "merge_size": 2, "image_mean": [0.48, 0.46, 0.41], "image_std": [0.27, 0.26, 0.28],
       "image_processor_type": "Qwen2VLImageProcessorFast"}
MAX_IMAGES = 2
MAX_IMAGE_BYTES = 20_000
MAX_IMAGE_PIXELS = 10_000
# 37x53 resizes to 24x32 pixels = 12 merged tokens (patch 4, merge 2), 60x20 to 64x16 = 16: exactly the budget
VISION_TOKENS = 28
NEW = 8
SEED = 11          # a tiny model whose greedy tokens visibly depend on the image pixels (checked below)


def _png(w: int, h: int, seed: int = 0, solid: bool = False) -> bytes:
    rng = np.random.default_rng(seed)
    px = np.full((h, w, 3), 90, np.uint8) if solid else rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(px).save(buf, format="PNG")
    return buf.getvalue()


def _uri(raw: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(raw).decode()


URIS = [_uri(_png(37, 53, seed=1)), _uri(_png(60, 20, seed=2))]


def _messages(urls: list[str], text: str = "describe") -> list[dict]:
    parts = [{"type": "text", "text": text}]
    for u in urls:
        parts += [{"type": "image_url", "image_url": {"url": u}}, {"type": "text", "text": " and"}]
    return [{"role": "user", "content": parts}]


def _write_artifact(out, tp: int) -> str:
    tiny = build_hf_model(seed=SEED, vision=True)
    cfg = model_config_from_hf(tiny.text_config, vision_config=tiny.vision_config)
    write_artifact(out, "model", cfg, artifact_tensors(tiny, tp=tp),
                   {**tiny_resources(), "preprocessor_config.json": json.dumps(PRE).encode()}, {"source": "hf_tiny"})
    return str(out)


@pytest.fixture(scope="module")
def artifact(tmp_path_factory) -> str:
    return _write_artifact(tmp_path_factory.mktemp("serve-vl"), tp=1)


def _vision_kw() -> dict:
    from ninfer_rt.vision.setup import VisionOptions
    return {"vision": VisionOptions(max_images=MAX_IMAGES, max_image_bytes=MAX_IMAGE_BYTES,
                                    max_image_pixels=MAX_IMAGE_PIXELS), "vision_max_tokens": VISION_TOKENS}


@pytest.fixture(scope="module")
def served(artifact, tmp_path_factory):
    from types import SimpleNamespace

    from ninfer_rt.server.request_log import RequestLog
    log_path = tmp_path_factory.mktemp("serve-vl-log") / "requests.jsonl"
    srv, rt = real_server(artifact, log=RequestLog(str(log_path)), **_vision_kw())
    yield SimpleNamespace(srv=srv, rt=rt, tok=rt.tokenizer, log_path=log_path)
    srv.close()
    rt.close()


def _engine_reference(artifact: str, messages: list[dict], max_tokens: int):
    """The Engine driven directly (no MTP, no server code): -> (generated ids, prompt ids, expanded length)."""
    from ninfer_rt.sampling import SamplingParams
    from ninfer_rt.vision import image_urls
    rt = real_runtime(artifact, max_concurrency=1, draft_tokens=0, **_vision_kw())
    try:
        tok, vis = rt.tokenizer, rt.vision
        ids = tok.encode(tok.render_chat(messages, add_generation_prompt=True))
        urls, _ = image_urls(messages)
        vr = vis.preprocess_request(ids, vis.load_images(urls))
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop_token_ids=tuple(sorted(tok.stop_ids)))
        rt.engine.add_request("ref", ids, params, vision=vr)
        out = []
        while rt.engine.has_work():
            for o in rt.engine.step():
                out += o.new_token_ids
        return out, ids, len(vr)
    finally:
        rt.close()


def _log_records(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


@pytest.fixture(scope="module")
def reference(artifact):
    ref = _engine_reference(artifact, _messages(URIS), NEW)
    # the same prompt with other pixels of the same size: if the tokens did not change, equality with the
    # server's output would not show that the server fed the model the request's images
    other = _engine_reference(artifact, _messages([_uri(_png(37, 53, seed=9)), URIS[1]]), NEW)
    assert other[2] == ref[2] and other[0] != ref[0]
    return ref


@pytest.mark.parametrize("stream", [False, True], ids=["blocking", "stream"])
def test_image_chat_equals_engine_and_is_counted(served, reference, stream):
    from ninfer_rt.server.handlers import splitter
    srv = served.srv
    msgs = _messages(URIS)
    ids, prompt_ids, n_prompt = reference
    want_reasoning, want_content = expected_text(served.tok, ids, splitter(served.tok, prompt_ids))
    names = ["ninfer_image_tokens_total", "ninfer_images_total", "ninfer_prompt_tokens_total"]
    before = {n: metric(srv, n) for n in names}
    c = srv.client()
    if stream:
        chunks = list(c.chat.completions.create(model=MODEL_ID, messages=msgs, max_tokens=NEW, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
        deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
        content = "".join(d.content or "" for d in deltas)
        reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
        use = chunks[-1].usage
    else:
        r = c.chat.completions.create(model=MODEL_ID, messages=msgs, max_tokens=NEW, temperature=0)
        content, use = r.choices[0].message.content, r.usage
        reasoning = getattr(r.choices[0].message, "reasoning_content", None) or ""
    assert (reasoning, content) == (want_reasoning, want_content)
    assert (use.prompt_tokens, use.completion_tokens) == (n_prompt, len(ids))
    assert n_prompt == len(prompt_ids) - 2 + VISION_TOKENS          # each 1-token placeholder became 12 / 16
    wait_idle(srv)
    after = {n: metric(srv, n) for n in names}
    assert after[names[0]] - before[names[0]] == VISION_TOKENS
    assert after[names[1]] - before[names[1]] == 2
    assert after[names[2]] - before[names[2]] == n_prompt
    rec = _log_records(served.log_path)[-1]
    assert rec["event"] == "request_done" and (rec["images"], rec["image_tokens"]) == (2, VISION_TOKENS)
    assert rec["prompt_tokens"] == n_prompt
    spec = rec["speculative"]                  # MTP K=2 ran on the image prompt
    assert spec["drafted"] > 0 and 0 <= spec["accepted"] <= spec["drafted"]
    pool, gdn = served.rt.engine.model.kv_pool, served.rt.engine.model.gdn_pool
    assert pool.free_pages() == pool.num_pages and gdn.free_slots() == gdn.max_seqs


def test_image_and_text_requests_batch_together(served):
    """An image request and text requests in flight at once: each equals what it gives when served alone."""
    from concurrent.futures import ThreadPoolExecutor
    c = served.srv.client()
    jobs = [_messages([URIS[1]], "one"), [{"role": "user", "content": "plain text"}], _messages([URIS[0]], "two")]

    def ask(m):
        r = c.chat.completions.create(model=MODEL_ID, messages=m, max_tokens=6, temperature=0)
        return r.choices[0].message.content, getattr(r.choices[0].message, "reasoning_content", None)
    alone = [ask(m) for m in jobs]
    with ThreadPoolExecutor(len(jobs)) as ex:
        together = list(ex.map(ask, jobs))
    assert together == alone


def test_tp2_vision_server_matches_the_tp1_engine(reference, tmp_path_factory):
    """Rank 0 holds the tower and sends the merged embeddings; rank 1 (a spawned process) never binds it."""
    from ninfer_rt.server.handlers import splitter
    srv, rt = real_server(_write_artifact(tmp_path_factory.mktemp("serve-vl-tp2"), tp=2), tp=2, **_vision_kw())
    try:
        ids, prompt_ids, n_prompt = reference
        r = srv.client().chat.completions.create(model=MODEL_ID, messages=_messages(URIS), max_tokens=NEW,
                                                 temperature=0)
        msg = r.choices[0].message
        want = expected_text(rt.tokenizer, ids, splitter(rt.tokenizer, prompt_ids))
        assert ((getattr(msg, "reasoning_content", None) or ""), msg.content) == want
        assert r.usage.prompt_tokens == n_prompt
        wait_idle(srv)
    finally:
        srv.close()
        rt.close()
    assert all(p.exitcode == 0 for p in rt.launch.procs)


def test_a_body_over_one_mib_is_served(served):
    """Bodies over BIG_BODY_BYTES (images as base64) are parsed in a worker thread: same answer."""
    from ninfer_rt.server.app import BIG_BODY_BYTES
    body = {"model": MODEL_ID, "messages": _messages(URIS[:1]), "max_tokens": 3, "temperature": 0}
    small = _post(served.srv, "/v1/chat/completions", body)
    big = _post(served.srv, "/v1/chat/completions", {**body, "pad": "x" * (BIG_BODY_BYTES + 1)})
    assert small.status_code == big.status_code == 200, big.text
    assert big.json()["choices"][0]["message"] == small.json()["choices"][0]["message"]
    assert big.json()["usage"] == small.json()["usage"]


def _bad_cases() -> list[tuple]:
    noise = _uri(_png(100, 100, seed=3))                    # random pixels: well over MAX_IMAGE_BYTES as PNG
    big = _uri(_png(200, 200, solid=True))                  # small file, 40000 pixels
    return [
        ("not-an-image", [_uri(b"hello, not a png")], "invalid_image", r"content\.1\.image_url: not an image"),
        ("bad-base64", ["data:image/png;base64,@@@@"], "invalid_image", r"not valid base64"),
        ("not-image-mime", [_uri(b"abc", "text/plain")], "invalid_image", r"'text/plain' is not image/\*"),
        ("too-many-images", URIS + URIS[:1], "invalid_image", r"3 images in one request, at most 2"),
        ("too-many-bytes", [noise], "invalid_image", rf"more than the {MAX_IMAGE_BYTES}-byte limit"),
        ("too-many-pixels", [big], "invalid_image", rf"200x200 = 40000 pixels, more than the {MAX_IMAGE_PIXELS}"),
        ("over-token-budget", [_uri(_png(64, 64, seed=4)), URIS[1]], "image_tokens_exceeded",
         rf"32 image tokens, more than this server's limit of {VISION_TOKENS} .*--vision-max-tokens"),
        ("http-url", ["https://example.com/cat.png"], "invalid_image", r"http\(s\) image URLs are not fetched"),
        ("local-file", ["/etc/hostname"], "invalid_image", r"local file paths are not accepted"),
        ("empty-url", [""], "invalid_image", r"expected a non-empty image URL"),
    ]


@pytest.mark.parametrize("urls,code,message", [b[1:] for b in _bad_cases()], ids=[b[0] for b in _bad_cases()])
def test_bad_images_are_400s_and_the_server_keeps_serving(served, urls, code, message):
    srv = served.srv
    before = metric(srv, "ninfer_image_tokens_total")
    r = _post(srv, "/v1/chat/completions", {"model": MODEL_ID, "messages": _messages(urls), "max_tokens": 2})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["code"] == code and re.search(message, err["message"]), err
    assert "\n" not in err["message"]
    assert err["param"].startswith("messages")
    ok = _post(srv, "/v1/chat/completions", {"model": MODEL_ID, "messages": _messages(URIS[:1]), "max_tokens": 1})
    assert ok.status_code == 200, ok.text
    wait_idle(srv)
    assert metric(srv, "ninfer_image_tokens_total") == before + 12     # only the good request counted


def test_openai_client_raises_bad_request_for_a_bad_image(served):
    import openai
    with pytest.raises(openai.BadRequestError, match="not an image"):
        served.srv.client().chat.completions.create(model=MODEL_ID, max_tokens=2,
                                                    messages=_messages([_uri(b"GIF89a but not really")]))


def test_without_vision_the_tower_stays_in_the_file_and_images_are_400(artifact):
    srv, rt = real_server(artifact, draft_tokens=0)
    try:
        assert rt.vision is None and not [n for n in rt.loaded.weights if n.startswith("visual.")]
        r = _post(srv, "/v1/chat/completions", {"model": MODEL_ID, "messages": _messages(URIS[:1]), "max_tokens": 2})
        assert r.status_code == 400
        err = r.json()["error"]
        assert "--vision" in err["message"] and err["code"] == "vision_disabled"
        assert err["param"] == "messages.0.content.1.image_url"
        ok = srv.client().chat.completions.create(model=MODEL_ID, max_tokens=2,
                                                  messages=[{"role": "user", "content": "text still works"}])
        assert ok.usage.completion_tokens >= 1
        assert metric(srv, "ninfer_image_tokens_total") == 0
    finally:
        srv.close()
        rt.close()


def test_serve_options_refuse_local_image_files():
    from ninfer_rt.server.runtime import RuntimeOptions, ServeError
    from ninfer_rt.server.serve import ServeOptions
    from ninfer_rt.vision.setup import VisionOptions
    with pytest.raises(ServeError, match="never reads image files"):
        ServeOptions(runtime=RuntimeOptions(artifact="x", vision=VisionOptions(allow_files=True)))
    with pytest.raises(ServeError, match="--vision-max-tokens: expected a positive integer"):
        RuntimeOptions(artifact="x", vision=VisionOptions(), vision_max_tokens=0)


def test_auto_kv_headroom_scales_with_the_vision_budget():
    """Pure arithmetic of the auto-KV headroom: the tower workspace scales with --vision-max-tokens."""
    from ninfer_rt.server.runtime import RuntimeOptions, vision_workspace_bytes
    from ninfer_rt.vision.setup import VisionOptions
    tiny = build_hf_model(seed=7, vision=True)
    cfg = model_config_from_hf(tiny.text_config, vision_config=tiny.vision_config)
    text = RuntimeOptions(artifact="x")
    small, large = (RuntimeOptions(artifact="x", vision=VisionOptions(), vision_max_tokens=n) for n in (100, 300))
    assert vision_workspace_bytes(cfg, text) == 0
    assert 0 < vision_workspace_bytes(cfg, small) and vision_workspace_bytes(cfg, large) == \
        3 * vision_workspace_bytes(cfg, small)


@pytest.mark.parametrize("args,needle", [
    (["--max-images", "2"], "--max-images: only applies with --vision"),
    (["--vision-max-tokens", "64"], "--vision-max-tokens: only applies with --vision"),
    (["--vision", "--max-images", "0"], "--max-images"),
], ids=["limit-without-vision", "budget-without-vision", "zero-images"])
def test_cli_vision_flag_errors_are_one_line(artifact, args, needle):
    from click.testing import CliRunner

    from ninfer_rt.cli import main
    res = CliRunner().invoke(main, ["serve", artifact, "--port", "0", "--device", "cpu", *args])
    assert res.exit_code == 2, res.output
    assert needle in res.output and "Traceback" not in res.output
    assert sum(line.startswith(("error:", "Error:")) for line in res.output.splitlines()) == 1


def test_cli_vision_server_answers_an_image_request(artifact):
    """The real `ninfer-rt serve --vision` process: tower bound at load, an image request served."""
    import signal

    from test_serve_cli import _start_cli, wait_healthy
    proc, addr, _ = _start_cli([artifact, "--port", "0", "--device", "cpu", "--max-context", "256",
                                "--model-id", MODEL_ID, "--no-verify", "--vision", "--vision-max-tokens", str(VISION_TOKENS)])
    url = f"http://{addr}"
    try:
        wait_healthy(url, proc)
        body = {"model": MODEL_ID, "messages": _messages(URIS), "max_tokens": 3}
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] > VISION_TOKENS
        body["messages"] = _messages(URIS + URIS[:1])           # 12 + 16 + 12 tokens > the budget
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["code"] == "image_tokens_exceeded"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
