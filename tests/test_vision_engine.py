"""Image requests through the Engine, MTP, TP followers and `ninfer-rt generate --vision` (tiny random VL model):
greedy tokens equal HF Qwen3_5ForConditionalGeneration teacher-forced argmax, MTP stays lossless and its
first drafts equal the oracle at MRoPE positions, TP2 equals TP1, the tower stays off the device without
--vision, and bad image input is a one-line error."""
from __future__ import annotations

import base64
import io
import json
import os
import re
import types

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from hf_tiny import (SPECIALS, artifact_tensors, artifact_weights, build_hf_model, make_tiny_artifact,
                     make_tiny_checkpoint, model_config_from_hf, tiny_resources)
from PIL import Image
from tp_vision_workers import vision_rank_program

from ninfer_formats.container import write_artifact
from ninfer_rt.backends.torch_ops import TorchOps
from ninfer_rt.cli import main
from ninfer_rt.engine import Engine, EngineError
from ninfer_rt.sampling import SamplingParams
from ninfer_rt.speculative import SpecConfig
from ninfer_rt.vision import VisionRuntime, mrope_positions, placeholder_runs
from numerics import rel

IMG, VS, VE = SPECIALS["<|image_pad|>"], SPECIALS["<|vision_start|>"], SPECIALS["<|vision_end|>"]
PRE = {"size": {"shortest_edge": 16 * 16, "longest_edge": 32 * 32}, "patch_size": 4, "temporal_patch_size": 2,
       "merge_size": 2, "image_mean": [0.48, 0.46, 0.41], "image_std": [0.27, 0.26, 0.28],
       "image_processor_type": "Qwen2VLImageProcessorFast"}
RESOURCES = {"preprocessor_config.json": json.dumps(PRE).encode()}
CHUNK, NEW = 7, 8             # chunk 7: image runs straddle prefill chunk boundaries
MTP_TOL = 1e-4                # rel L2 of engine first-draft logits vs the fp32 MTP oracle
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
_rng = np.random.default_rng(3)
PROMPT = _rng.integers(0, 240, 5).tolist() + [VS, IMG, VE] + _rng.integers(0, 240, 3).tolist() + \
    [VS, IMG, VE] + _rng.integers(0, 240, 4).tolist()
TEXT = _rng.integers(0, 240, 12).tolist()




def _images() -> list[Image.Image]:
    rng = np.random.default_rng(8)
    return [Image.fromarray(rng.integers(0, 256, (37, 53, 3), dtype=np.uint8)),
            Image.fromarray(rng.integers(0, 256, (60, 20, 3), dtype=np.uint8))]


def _png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _uri(raw: bytes, mime="image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(raw).decode()


URIS = [_uri(_png(i)) for i in _images()]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny():
    return build_hf_model(seed=7, vision=True)          # with the MTP oracle


@pytest.fixture(scope="module")
def loaded(tiny):
    cfg = model_config_from_hf(tiny.text_config, vision_config=tiny.vision_config)
    return types.SimpleNamespace(config=cfg, weights=artifact_weights(tiny), resources=RESOURCES, path="tiny-vl")


@pytest.fixture(scope="module")
def vis(loaded):
    return VisionRuntime.from_loaded(loaded, TorchOps())


@pytest.fixture(scope="module")
def vreq(vis):
    return vis.preprocess_request(PROMPT, vis.load_images(URIS))


def run(engine, requests) -> dict[str, list[int]]:
    for rid, ids, vr in requests:
        engine.add_request(rid, ids, GREEDY, vision=vr)
    out = {rid: [] for rid, _, _ in requests}
    while engine.has_work():
        for o in engine.step():
            out[o.req_id] += o.new_token_ids
    assert engine.model.kv_pool.free_pages() == engine.cache.num_pages
    return out


@pytest.fixture(scope="module")
def reference(loaded, vis, vreq):
    """Image and text requests batched together (1-D and 3-D positions in one forward), no MTP."""
    return run(Engine(loaded, TorchOps(), prefill_chunk=CHUNK, vision=vis), [("img", PROMPT, vreq), ("txt", TEXT, None)])


def _hf(tiny, ids: list[int], vr=None, **kw):
    full = torch.tensor(ids)[None]
    img = {} if vr is None else {"pixel_values": vr.pixel_values, "image_grid_thw": vr.grid_thw,
                                 "mm_token_type_ids": (full == IMG).int()}
    with torch.no_grad():
        return tiny.model(input_ids=full, **img, **kw)


def test_image_request_matches_hf_teacher_forced(tiny, vreq, reference):
    runs = placeholder_runs(vreq.token_ids, IMG)
    assert len(runs) == 2 and any(a // CHUNK != (b - 1) // CHUNK for a, b in runs)
    for rid, prompt, vr in (("img", vreq.token_ids, vreq), ("txt", TEXT, None)):
        toks = reference[rid]
        logits = _hf(tiny, prompt + toks[:-1], vr).logits[0]
        assert logits[len(prompt) - 1:].argmax(-1).tolist() == toks, rid


@pytest.mark.parametrize("k", [1, 3], ids=["K1", "K3"])
def test_mtp_with_images_is_lossless(loaded, vis, vreq, reference, k):
    eng = Engine(loaded, TorchOps(), spec=SpecConfig(num_draft_tokens=k), prefill_chunk=CHUNK, vision=vis)
    assert run(eng, [("img", PROMPT, vreq), ("txt", TEXT, None)]) == reference
    assert eng.stats.spec.rounds > 0 and eng.stats.spec.drafted > 0


def _oracle_3d(m, embed, ids, hidden, pos3) -> torch.Tensor:
    """The hf_tiny MTP oracle with 3-axis MRoPE positions [3, T] (its forward takes 1-D ones)."""
    t = ids.shape[0]
    u = m.fc(torch.cat([m.pre_fc_norm_embedding(embed(ids)), m.pre_fc_norm_hidden(hidden)], dim=-1))[None]
    cos_sin = m.rotary_emb(u, pos3[:, None, :])
    mask = torch.full((t, t), torch.finfo(u.dtype).min, dtype=u.dtype).triu(1)[None, None]
    return m.norm(m.layers[0](u, position_embeddings=cos_sin, attention_mask=mask))[0]


def test_first_draft_matches_mtp_oracle_at_mrope_positions(tiny, loaded, vis, vreq, lm_head_drafts):
    """MTP row p takes the target's position of row p: prompt rows their MRoPE triple, later rows
    row + rope_delta. Drafts after prefill and after each re-alignment equal the oracle's."""
    seen = []

    class Spy(Engine):
        def _spy(self, j, items):
            if j == 1:
                seen.extend((s.prompt + list(s.out), lg.clone()) for s, lg, _ in items)

        def _decide_drafts(self, j, items):
            self._spy(j, items)
            return super()._decide_drafts(j, items)

        def _device_drafts(self, j, items):        # greedy drafts stay on the device (NINFER_DRAFT_CHAIN)
            self._spy(j, items)
            return super()._device_drafts(j, items)

    run(Spy(loaded, TorchOps(), spec=SpecConfig(num_draft_tokens=2), prefill_chunk=CHUNK, vision=vis),
        [("img", PROMPT, vreq)])
    pos, delta = mrope_positions(vreq.token_ids, vreq.grid_thw, IMG, 2)
    assert len(seen) >= 3 and delta != 0
    for tokens, lg in seen:
        ids = torch.tensor(tokens)
        n = len(tokens) - 1
        h = _hf(tiny, tokens[:-1], vreq, output_hidden_states=True).hidden_states[-1][0]
        pos3 = torch.cat([pos, (torch.arange(len(pos[0]), n) + delta).expand(3, -1)], dim=1)
        with torch.no_grad():
            want = tiny.lm_head(_oracle_3d(tiny.mtp, tiny.embed, ids[1:], h, pos3)[-1])
        assert rel(lg, want) <= MTP_TOL


def test_engine_refuses_mismatched_image_requests(loaded, vis, vreq, tiny):
    with pytest.raises(EngineError, match=r"has images.*without vision \(--vision\)"):
        Engine(loaded, TorchOps()).add_request("a", PROMPT, GREEDY, vision=vreq)
    eng = Engine(loaded, TorchOps(), vision=vis)
    with pytest.raises(EngineError, match="prepared from other prompt ids"):
        eng.add_request("a", TEXT, GREEDY, vision=vreq)
    other = build_hf_model(seed=1, vision=True, hidden=32)
    cfg = model_config_from_hf(other.text_config, vision_config=other.vision_config)
    with pytest.raises(EngineError, match="another artifact's config"):
        eng.attach_vision(VisionRuntime(cfg, artifact_weights(other), RESOURCES, TorchOps()))
    assert not eng.has_work()


# ---- TP and the loader ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tp_artifacts(tiny, tmp_path_factory):
    base = tmp_path_factory.mktemp("vl")
    cfg = model_config_from_hf(tiny.text_config, vision_config=tiny.vision_config)
    for tp in (1, 2):
        write_artifact(base / f"tp{tp}", "model", cfg, artifact_tensors(tiny, tp=tp),
                       {**tiny_resources(), **RESOURCES}, {"source": "hf_tiny"})
    return base


def test_tp2_image_request_matches_tp1(tp_artifacts):
    from ninfer_rt.tp import launch
    from ninfer_rt.tp_group import LocalGroup
    args = (PROMPT, URIS, TEXT, 2)
    one = vision_rank_program(LocalGroup(), tp_artifacts / "tp1", *args)
    with launch(2, vision_rank_program, (tp_artifacts / "tp2", *args)) as lch:
        two = vision_rank_program(lch.group, tp_artifacts / "tp2", *args)
    assert two == one and len(one["img"]) == NEW
    assert all(p.exitcode == 0 for p in lch.procs)     # followers: no tower bound, clean stop


def test_loader_leaves_the_tower_in_the_file_unless_asked(tp_artifacts):
    from ninfer_rt.loader import load
    lm = load(tp_artifacts / "tp1")
    assert not [n for n in lm.weights if n.startswith("visual.")]
    eager = load(tp_artifacts / "tp1", vision=True)
    bound = lm.bind_vision()
    assert set(bound) == {n for n in eager.weights if n.startswith("visual.")} and len(bound) > 10
    assert all(torch.equal(bound[n], eager.weights[n]) for n in bound)
    assert lm.bind_vision().keys() == bound.keys() and all(lm.weights[n] is bound[n] for n in bound)


# ---- ninfer-rt generate --vision --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    from ninfer_pack.convert import convert
    base = tmp_path_factory.mktemp("gen-vl")
    make_tiny_checkpoint(base / "hf", seed=7, vision=True)
    (base / "hf" / "preprocessor_config.json").write_text(json.dumps(PRE))
    convert(str(base / "hf"), base / "art", recipe="bf16", tp=1, jobs=1, progress=False)
    return base / "art"


def cli(*args):
    res = CliRunner().invoke(main, ["generate", *map(str, args)])
    assert not isinstance(res.exception, Exception) or isinstance(res.exception, SystemExit), res.exception
    return res


def _messages(tmp_path, urls: list[str]) -> str:
    parts = [{"type": "text", "text": "look"}]
    for u in urls:
        parts += [{"type": "image_url", "image_url": {"url": u}}, {"type": "text", "text": "and"}]
    path = tmp_path / "m.json"
    path.write_text(json.dumps([{"role": "user", "content": parts}]))
    return str(path)


def _engine_text(art, msgs_path) -> tuple[str, int]:
    """The same request built by hand from the library pieces (no CLI code)."""
    from ninfer_rt.loader import load
    from ninfer_rt.tokenizer import TextStream, Tokenizer
    from ninfer_rt.vision import ImageLimits
    lm = load(art, vision=True)
    tok = Tokenizer.from_resources(lm.resources, eos_token_ids=lm.config.eos_token_ids)
    with open(msgs_path) as f:
        msgs = json.load(f)
    ids = tok.encode(tok.render_chat(msgs, add_generation_prompt=True))
    vis = VisionRuntime.from_loaded(lm, TorchOps(), limits=ImageLimits(allow_files=True))
    urls = [p["image_url"]["url"] for p in msgs[0]["content"] if p["type"] == "image_url"]
    urls = [u if u.startswith("data:") else os.path.join(os.path.dirname(msgs_path), u) for u in urls]
    vr = vis.preprocess_request(ids, vis.load_images(urls))
    eng = Engine(lm, TorchOps(), vision=vis, tokenizer=None)
    params = SamplingParams(temperature=0, max_tokens=6, stop_token_ids=tuple(sorted(tok.stop_ids)))
    eng.add_request("x", ids, params, vision=vr)
    stream, text = TextStream(tok), ""
    while eng.has_work():
        for o in eng.step():
            text += stream.push(o.new_token_ids)
    return text + stream.flush() + "\n", len(vr)


def test_generate_vision_messages_end_to_end(packed, tmp_path):
    """A data URI and a local file (relative to the messages file); MTP gives the same text."""
    (tmp_path / "pic.png").write_bytes(_png(_images()[1]))
    msgs = _messages(tmp_path, [URIS[0], "pic.png"])
    stats = tmp_path / "s.json"
    common = ["--vision", "--messages", msgs, "--max-new", "6", "--temperature", "0"]
    plain = cli(packed, *common, "--stats-json", stats)
    assert plain.exit_code == 0, plain.stderr
    spec = cli(packed, *common, "--spec", "mtp", "--draft-tokens", "2")
    assert spec.exit_code == 0, spec.stderr
    want, n_prompt = _engine_text(packed, msgs)
    assert plain.stdout == spec.stdout == want
    s = json.loads(stats.read_text())
    assert s["prompt_tokens"] == n_prompt and n_prompt > len(PROMPT) and s["generated_tokens"] >= 1


def test_generate_vision_tp2_matches_tp1(tp_artifacts, tmp_path):
    """The real multi-process CLI path: rank 0 runs the tower, rank 1 receives the embeddings."""
    msgs = _messages(tmp_path, URIS)
    args = ["--vision", "--messages", msgs, "--max-new", "5", "--temperature", "0", "--spec", "mtp",
            "--draft-tokens", "2"]
    one, two = cli(tp_artifacts / "tp1", *args), cli(tp_artifacts / "tp2", *args, "--tp", "2")
    assert one.exit_code == 0 and two.exit_code == 0, two.stderr
    assert two.stdout == one.stdout and one.stdout.strip()


def test_generate_without_vision_never_binds_the_tower(packed, monkeypatch):
    from ninfer_rt.loader import LoadedModel

    def refuse(self):
        raise AssertionError("bind_vision called without --vision")

    monkeypatch.setattr(LoadedModel, "bind_vision", refuse)
    res = cli(packed, "--prompt", "hi", "--max-new", "3")
    assert res.exit_code == 0, res.stderr


@pytest.fixture(scope="module")
def text_only(tmp_path_factory):
    d = tmp_path_factory.mktemp("text-only")
    make_tiny_artifact(d, build_hf_model(seed=1, mtp=False))
    return d


@pytest.mark.parametrize("case,urls,args,message", [
    ("packed", ["URI0"], [], r"m\.json: messages\.0\.content\.1\.image_url: the messages hold 1 image.*--vision"),
    ("packed", ["NOTIMG"], ["--vision"], r"messages\.0\.content\.1\.image_url: not an image"),
    ("packed", ["URI0", "URI1"], ["--vision", "--max-images", "1"], r"2 images in one request, at most 1"),
    ("packed", ["nope.png"], ["--vision"], r"image_url: cannot read .*nope\.png"),
    ("packed", ["URI0"], ["--vision", "--max-image-pixels", "100"], r"53x37 = 1961 pixels, more than the 100-pixel limit"),
    ("packed", [], ["--max-images", "2"], r"--max-images: only applies with --vision"),
    ("text_only", ["URI0"], ["--vision"], r"no vision tower"),
], ids=["image-without-vision", "not-an-image", "too-many-images", "missing-file", "too-many-pixels",
        "limit-without-vision", "artifact-without-tower"])
def test_bad_image_input_is_one_line_error(packed, text_only, tmp_path, case, urls, args, message):
    urls = [{"URI0": URIS[0], "URI1": URIS[1], "NOTIMG": _uri(b"hello, not a png")}.get(u, u) for u in urls]
    art = {"packed": packed, "text_only": text_only}[case]
    res = cli(art, "--messages", _messages(tmp_path, urls), "--max-new", "2", *args)
    assert res.exit_code == 2, (res.exit_code, res.stderr)
    errors = [ln for ln in res.stderr.strip().splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and res.stderr.strip().endswith(errors[0]), res.stderr
    assert re.search(message, errors[0]), errors[0]
    assert "Traceback" not in res.stderr and res.stdout == ""
