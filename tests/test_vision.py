"""ninfer_rt.vision against transformers' tiny random Qwen3_5ForConditionalGeneration (reference §6, §14, §16):
tower embeddings, MRoPE positions / rope delta, the image processor, image+text logits through the model
hooks, and one-line VisionError for bad inputs."""
from __future__ import annotations

import base64
import copy
import dataclasses
import functools
import io
import json

import numpy as np
import pytest
import torch
from hf_tiny import SPECIALS, artifact_weights, build_hf_model, model_config_from_hf
from PIL import Image

from ninfer_formats import codecs
from ninfer_formats.errors import NinferError
from ninfer_rt.backends.torch_ops import TorchOps
from ninfer_rt.vision import (ImageLimits, PreprocessConfig, VisionError, VisionRuntime, VisionTower, image_urls,
                              load_images, mrope_positions, preprocess_images)
from ninfer_rt.weights import dequantize, from_encoded
from numerics import rel

TOWER_TOL = 1e-4            # rel L2, fp32, vs HF model.visual
TOWER_BF16_TOL = 2e-2       # bf16 weights + activations vs the fp32 HF tower holding the same rounded weights
LOGITS_TOL = 1e-4           # rel L2, fp32, image+text logits vs HF
IMG, VS, VE = SPECIALS["<|image_pad|>"], SPECIALS["<|vision_start|>"], SPECIALS["<|vision_end|>"]
PRE = {"size": {"shortest_edge": 16 * 16, "longest_edge": 32 * 32}, "patch_size": 4, "temporal_patch_size": 2,
       "merge_size": 2, "image_mean": [0.48, 0.46, 0.41], "image_std": [0.27, 0.26, 0.28],
       "image_processor_type": "Qwen2VLImageProcessorFast"}
GRIDS = {"square": [[1, 4, 4]], "two_grids": [[1, 4, 8], [1, 6, 4]], "video_like_t2": [[2, 4, 4]],
         "three": [[1, 2, 2], [1, 8, 6], [1, 4, 4]]}




@functools.lru_cache(maxsize=None)
def _tiny():
    tiny = build_hf_model(seed=5, vision=True, mtp=False)
    cfg = dataclasses.replace(model_config_from_hf(tiny.text_config, mtp=False, vision_config=tiny.vision_config),
                              image_token_id=IMG, vision_start_token_id=VS, vision_end_token_id=VE)
    return tiny, cfg, artifact_weights(tiny)


@pytest.fixture(scope="module")
def tiny():
    return _tiny()


def _pixels(grid, seed=0) -> torch.Tensor:
    n = int(torch.tensor(grid).prod(-1).sum())
    return torch.randn(n, 96, generator=torch.Generator().manual_seed(seed))


def _hf_visual(model, pixels, grid) -> torch.Tensor:
    with torch.no_grad():
        return model.model.visual(pixels, grid_thw=torch.tensor(grid)).pooler_output


# ---- (1) tower ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(GRIDS))
def test_tower_matches_hf(tiny, name):
    hf, cfg, w = tiny
    grid = GRIDS[name]
    pix = _pixels(grid, seed=len(name))
    out = VisionTower(cfg.vision, w, TorchOps())(pix, torch.tensor(grid))
    assert [o.shape[0] for o in out] == [t * h * ww // 4 for t, h, ww in grid]
    assert rel(torch.cat(out), _hf_visual(hf.model, pix, grid)) <= TOWER_TOL


def test_tower_images_are_independent(tiny):
    """Two images in one call give the same embeddings as each alone (attention stays inside an image)."""
    _, cfg, w = tiny
    tower, grid = VisionTower(cfg.vision, w, TorchOps()), GRIDS["two_grids"]
    pix = _pixels(grid, seed=3)
    both = tower(pix, torch.tensor(grid))
    first = tower(pix[:32], torch.tensor(grid[:1]))[0]
    second = tower(pix[32:], torch.tensor(grid[1:]))[0]
    assert rel(both[0], first) <= 1e-6 and rel(both[1], second) <= 1e-6


def test_tower_bf16(tiny):
    hf, cfg, w = tiny
    w16 = {k: (v.to(torch.bfloat16) if k.startswith("visual.") and v.dim() == 2 else v) for k, v in w.items()}
    ref = copy.deepcopy(hf.model).float()
    with torch.no_grad():
        for n, p in ref.model.visual.named_parameters():
            p.copy_(p.to(torch.bfloat16).float())
    grid = GRIDS["two_grids"]
    pix = _pixels(grid, seed=9)
    got = torch.cat(VisionTower(cfg.vision, w16, TorchOps(), dtype=torch.bfloat16)(pix, torch.tensor(grid)))
    assert got.dtype == torch.bfloat16
    assert rel(got.float(), _hf_visual(ref, pix, grid)) <= TOWER_BF16_TOL


def test_tower_quantized_linears(tiny):
    """nvfp4 QWeights go through ops.linear: equal to the tower holding their dequantized values."""
    _, cfg, w = tiny
    q, dq = dict(w), dict(w)
    for k, v in w.items():
        if k.startswith("visual.") and k.endswith(".weight") and v.dim() == 2 and "pos_embed" not in k:
            qw = from_encoded("nvfp4", v.shape, codecs.encode("nvfp4", v.numpy()), name=k)
            q[k], dq[k] = qw, dequantize(qw)
    grid = GRIDS["square"]
    pix = _pixels(grid, seed=4)
    got = torch.cat(VisionTower(cfg.vision, q, TorchOps())(pix, torch.tensor(grid)))
    want = torch.cat(VisionTower(cfg.vision, dq, TorchOps())(pix, torch.tensor(grid)))
    assert rel(got, want) <= 1e-6


@pytest.mark.parametrize("pix_shape,grid,msg", [
    ((16, 95), [[1, 4, 4]], "expected [N, 96]"),
    ((15, 96), [[1, 4, 4]], "needs 16"),
    ((12, 96), [[1, 3, 4]], "multiples of the merge size"),
    ((0, 96), [[0, 4, 4]], "positive"),
], ids=["patch_dim", "patch_count", "odd_grid", "zero_grid"])
def test_tower_rejects_bad_inputs(tiny, pix_shape, grid, msg):
    _, cfg, w = tiny
    with pytest.raises(VisionError, match=msg.replace("[", r"\[").replace("]", r"\]")):
        VisionTower(cfg.vision, w, TorchOps())(torch.zeros(pix_shape), torch.tensor(grid))


def test_tower_missing_weight_is_load_error(tiny):
    _, cfg, w = tiny
    w = {k: v for k, v in w.items() if k != "visual.blocks.1.attn.proj.bias"}
    with pytest.raises(NinferError, match="visual.blocks.1.attn.proj.bias: missing"):
        VisionTower(cfg.vision, w, TorchOps())


# ---- (2) positions -------------------------------------------------------------------------------------

def _layout(pattern: list, grids) -> list[int]:
    """'t3' = 3 text tokens, 'i' = next image wrapped in vision start/end with its full placeholder run."""
    ids, g, rng = [], iter(grids), np.random.default_rng(len(pattern))
    for p in pattern:
        if p == "i":
            t, h, w = next(g)
            ids += [VS] + [IMG] * (t * h * w // 4) + [VE]
        else:
            ids += rng.integers(0, 240, int(p[1:])).tolist()
    return ids


POS_CASES = {
    "reference_example": (["t2", "i", "t3"], [[1, 4, 4]]),
    "image_first": (["i", "t5"], [[1, 4, 8]]),
    "image_last": (["t4", "i"], [[1, 8, 4]]),
    "two_images": (["t3", "i", "t2", "i", "t7"], [[1, 4, 8], [1, 6, 4]]),
    "adjacent_images": (["t1", "i", "i", "t1"], [[1, 2, 2], [1, 8, 6]]),
    "temporal_2": (["t2", "i", "t2"], [[2, 4, 4]]),
}


@pytest.mark.parametrize("name", list(POS_CASES))
def test_positions_equal_hf_get_rope_index(tiny, name):
    hf, _, _ = tiny
    pattern, grids = POS_CASES[name]
    ids = torch.tensor(_layout(pattern, grids))
    pos, delta = mrope_positions(ids, grids, IMG, 2)
    ref_pos, ref_delta = hf.model.model.get_rope_index(ids[None], (ids == IMG).int()[None],
                                                       image_grid_thw=torch.tensor(grids))
    assert torch.equal(pos, ref_pos[:, 0]) and delta == int(ref_delta)


def test_positions_reference_numbers():
    """Reference §6's observed example, grid (1, 4, 4): 4 image tokens between 3 and 4 text tokens."""
    pos, delta = mrope_positions([1, 2, VS, IMG, IMG, IMG, IMG, VE, 3, 4, 5], [[1, 4, 4]], IMG, 2)
    assert pos.tolist() == [[0, 1, 2, 3, 3, 3, 3, 5, 6, 7, 8], [0, 1, 2, 3, 3, 4, 4, 5, 6, 7, 8],
                            [0, 1, 2, 3, 4, 3, 4, 5, 6, 7, 8]]
    assert delta == -2


@pytest.mark.parametrize("ids,grids,msg", [
    ([1, IMG, IMG, 2], [[1, 4, 4]], "has 2 tokens, its image needs 4"),
    ([1, IMG, 2], [], "1 image placeholder runs for 0 images"),
    ([1, 2], [[1, 4, 4]], "0 image placeholder runs for 1 images"),
], ids=["run_length", "no_grid", "no_run"])
def test_positions_reject_mismatch(ids, grids, msg):
    with pytest.raises(VisionError, match=msg):
        mrope_positions(ids, grids or None, IMG, 2)


# ---- (3) preprocessing vs the HF image processor ---------------------------------------------------------

def _synthetic_images() -> dict:
    rng = np.random.default_rng(11)
    pal = Image.fromarray(rng.integers(0, 16, (23, 31), dtype=np.uint8), "P")
    pal.putpalette(rng.integers(0, 256, 48, dtype=np.uint8).tolist())
    pal.info["transparency"] = 3
    grad = np.linspace(0, 255, 300 * 41, dtype=np.float64).reshape(41, 300)
    return {"rgb_odd_37x53": Image.fromarray(rng.integers(0, 256, (37, 53, 3), dtype=np.uint8)),
            "rgba_150x90_downscaled": Image.fromarray(rng.integers(0, 256, (150, 90, 4), dtype=np.uint8), "RGBA"),
            "gray_9x20_upscaled": Image.fromarray(rng.integers(0, 256, (9, 20), dtype=np.uint8), "L"),
            "palette_transparency": pal,
            "wide_gradient_41x300": Image.fromarray(np.stack([grad] * 3, -1).astype(np.uint8))}


@pytest.fixture(scope="module")
def hf_processor(tmp_path_factory):
    from transformers import AutoImageProcessor
    d = tmp_path_factory.mktemp("pre")
    (d / "preprocessor_config.json").write_text(json.dumps(PRE))
    return AutoImageProcessor.from_pretrained(str(d))       # offline: a local folder


@pytest.mark.parametrize("name", list(_synthetic_images()))
def test_preprocess_equals_hf_processor(tiny, hf_processor, name):
    img = _synthetic_images()[name]
    ref = hf_processor(images=[img], return_tensors="pt")
    pix, grid = preprocess_images([img], PreprocessConfig.from_json(PRE, tiny[1].vision))
    assert torch.equal(grid, ref["image_grid_thw"])
    assert torch.equal(pix, ref["pixel_values"])


def test_preprocess_batch_equals_hf_processor(tiny, hf_processor):
    imgs = list(_synthetic_images().values())
    ref = hf_processor(images=imgs, return_tensors="pt")
    pix, grid = preprocess_images(imgs, PreprocessConfig.from_json(PRE, tiny[1].vision))
    assert torch.equal(grid, ref["image_grid_thw"]) and torch.equal(pix, ref["pixel_values"])


def test_preprocess_config_legacy_keys_and_errors(tiny):
    v = tiny[1].vision
    legacy = PreprocessConfig.from_json({**PRE, "min_pixels": 100, "max_pixels": 5000}, v)
    assert (legacy.min_pixels, legacy.max_pixels) == (100, 5000)
    with pytest.raises(VisionError, match="patch_size 14 differs from the model's vision_config"):
        PreprocessConfig.from_json({**PRE, "patch_size": 14}, v)
    with pytest.raises(VisionError, match="preprocessor_config.json: the artifact has no image preprocessor"):
        PreprocessConfig.from_resources({}, v)
    with pytest.raises(VisionError, match="image_std values must be positive"):
        PreprocessConfig.from_json({**PRE, "image_std": [0.5, 0, 0.5]}, v)


# ---- (4) image+text logits through the model hooks --------------------------------------------------------

def _data_uri(img: Image.Image, fmt="PNG") -> str:
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def _chat_ids(n_images: int) -> list[int]:
    """Template-style prompt: one <|image_pad|> per image, wrapped in vision start/end."""
    rng = np.random.default_rng(2)
    ids = rng.integers(0, 240, 5).tolist()
    for _ in range(n_images):
        ids += [VS, IMG, VE] + rng.integers(0, 240, 3).tolist()
    return ids + rng.integers(0, 240, 4).tolist()


@pytest.mark.parametrize("chunk", [7, 1000], ids=["chunk7", "oneshot"])
def test_image_text_logits_match_hf(tiny, hf_processor, chunk):
    from ninfer_rt.model import Model, SeqInput
    from ninfer_rt.state import CacheConfig
    hf, cfg, w = tiny
    ops = TorchOps()
    imgs = [_synthetic_images()["rgb_odd_37x53"], _synthetic_images()["wide_gradient_41x300"]]
    vis = VisionRuntime(cfg, w, {"preprocessor_config.json": json.dumps(PRE).encode()}, ops)
    vp = vis.prepare(_chat_ids(2), vis.load_images([_data_uri(i) for i in imgs]))
    decode = torch.tensor([17, 99, 3])
    # HF: full forward over prompt + decode tokens (text after the prompt sits at row + rope_delta)
    full = torch.cat([vp.token_ids, decode])[None]
    ref_in = hf_processor(images=imgs, return_tensors="pt")
    with torch.no_grad():
        ref = hf.model(input_ids=full, pixel_values=ref_in["pixel_values"], image_grid_thw=ref_in["image_grid_thw"],
                       mm_token_type_ids=(full == IMG).int()).logits[0]
    model = Model(cfg, w, ops, cache=CacheConfig(num_pages=16, page_size=16, max_seqs=2))
    st = model.new_state()
    got = []
    for ids in list(torch.split(vp.token_ids, chunk)) + list(torch.split(decode, 1)):
        got.append(model.forward([SeqInput(ids, st, **vp.seq_kwargs(model, st.length, ids))]).logits)
    assert rel(torch.cat(got), ref) <= LOGITS_TOL
    assert vp.rope_delta < 0 and torch.equal(vp.positions_for(len(vp), 2), torch.arange(2) + len(vp) + vp.rope_delta)


def test_expand_placeholders(tiny):
    _, cfg, w = tiny
    vis = VisionRuntime(cfg, w, {"preprocessor_config.json": json.dumps(PRE).encode()}, TorchOps())
    grids = torch.tensor([[1, 4, 4], [1, 2, 6]])
    assert vis.expand_placeholders([1, IMG, 2, IMG], grids) == [1] + [IMG] * 4 + [2] + [IMG] * 3
    assert vis.expand_placeholders([IMG] * 4 + [5, IMG], grids) == [IMG] * 4 + [5] + [IMG] * 3
    with pytest.raises(VisionError, match="2 image placeholders for 1 images"):
        vis.expand_placeholders([IMG, 1, IMG], grids[:1])
    with pytest.raises(VisionError, match="has 2 tokens, expected 1 or 4"):
        vis.expand_placeholders([IMG, IMG], grids[:1])


def test_vision_prompt_rows_past_the_prompt(tiny):
    """Decode rows get 1-D positions row + rope_delta and no embedding override; a chunk spanning the
    prompt end gets 3 rows (prompt part from the table, the rest shifted by the delta)."""
    from ninfer_rt.model import Model
    _, cfg, w = tiny
    ops = TorchOps()
    vis = VisionRuntime(cfg, w, {"preprocessor_config.json": json.dumps(PRE).encode()}, ops)
    vp = vis.prepare(_chat_ids(1), [_synthetic_images()["rgb_odd_37x53"]])
    model = Model(cfg, w, ops)
    t, d = len(vp), vp.rope_delta
    kw = vp.seq_kwargs(model, t + 3, torch.tensor([5, 6]))
    assert kw["inputs_embeds"] is None and kw["positions"].tolist() == [t + 3 + d, t + 4 + d]
    span = vp.positions_for(t - 2, 4)
    assert torch.equal(span[:, :2], vp.positions[:, -2:]) and span[:, 2:].tolist() == [[t + d, t + 1 + d]] * 3
    assert vp.seq_kwargs(model, 0, vp.token_ids[:5])["inputs_embeds"] is None       # text-only chunk


def test_two_phase_request_and_tp_meta(tiny):
    """preprocess_request (CPU) + encode_request (device) == prepare; meta/from_meta rebuilds the prompt
    (what the other TP ranks do with the broadcast embeddings) through a pickle round trip."""
    import pickle
    _, cfg, w = tiny
    vis = VisionRuntime(cfg, w, {"preprocessor_config.json": json.dumps(PRE).encode()}, TorchOps())
    imgs = [_synthetic_images()["gray_9x20_upscaled"], _synthetic_images()["rgb_odd_37x53"]]
    vr = vis.preprocess_request(_chat_ids(2), imgs)
    vp, ref = vis.encode_request(vr), vis.prepare(_chat_ids(2), imgs)
    assert len(vr) == len(vp) == len(ref) and vr.token_ids == ref.token_ids.tolist()
    assert torch.equal(vp.image_embeds, ref.image_embeds) and torch.equal(vp.positions, ref.positions)
    meta = pickle.loads(pickle.dumps(vp.meta()))
    back = type(vp).from_meta(meta, vp.image_embeds.clone())
    for f in dataclasses.fields(vp):
        a, b = getattr(vp, f.name), getattr(back, f.name)
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def test_vision_runtime_setup_errors(tiny):
    _, cfg, w = tiny
    res = {"preprocessor_config.json": json.dumps(PRE).encode()}
    with pytest.raises(NinferError, match="the artifact has no vision tower"):
        VisionRuntime(dataclasses.replace(cfg, vision=None), w, res, TorchOps())
    with pytest.raises(NinferError, match="model.image_token_id: missing"):
        VisionRuntime(dataclasses.replace(cfg, image_token_id=None), w, res, TorchOps())
    with pytest.raises(VisionError, match="below the preprocessor's min_pixels 256"):
        VisionRuntime(cfg, w, res, TorchOps(), max_pixels=100)
    small = VisionRuntime(cfg, w, res, TorchOps(), max_pixels=16 * 16)
    assert small.encode([_synthetic_images()["rgba_150x90_downscaled"]])[1].tolist() == [[1, 4, 2]]  # 16x8 px


# ---- (5) bad images -> one-line VisionError ----------------------------------------------------------------

def _png(w=8, h=8) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), (10, 20, 30)).save(buf, format="PNG")
    return buf.getvalue()


def _b64(raw: bytes, mime="image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(raw).decode()


BAD = {
    "not_an_image": (_b64(b"definitely not pixels" * 5), ImageLimits(), "not an image"),
    "truncated_png": (_b64(_png(64, 64)[:60]), ImageLimits(), "image 0: "),
    "text_mime": (_b64(_png(), "text/plain"), ImageLimits(), "is not image/*"),
    "not_base64": ("data:image/png;base64,@@@@", ImageLimits(), "not valid base64"),
    "no_base64_flag": ("data:image/png,abcd", ImageLimits(), "must be base64"),
    "malformed_uri": ("data:image/png;base64", ImageLimits(), "malformed data URI"),
    "too_many_bytes": (_b64(_png(64, 64)), ImageLimits(max_bytes=64), "more than the 64-byte limit"),
    "too_many_pixels": (_b64(_png(300, 200)), ImageLimits(max_pixels=50_000), "300x200 = 60000 pixels"),
    "http_url": ("https://example.com/cat.png", ImageLimits(), "not fetched by this server"),
    "file_not_allowed": ("/etc/hostname", ImageLimits(), "local file paths are not accepted"),
    "missing_file": ("/nonexistent/x.png", ImageLimits(allow_files=True), "cannot read /nonexistent/x.png"),
    "empty": ("", ImageLimits(), "empty image URL"),
    "wrong_type": (12, ImageLimits(), "expected an image URL string or bytes"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_image_is_one_line_vision_error(name):
    src, limits, msg = BAD[name]
    with pytest.raises(VisionError) as e:
        load_images([src], limits)
    assert isinstance(e.value, NinferError)
    assert "\n" not in str(e.value) and str(e.value).startswith("image 0: ") and msg in str(e.value)


def test_too_many_images():
    with pytest.raises(VisionError, match="3 images in one request, at most 2 are allowed"):
        load_images([_b64(_png())] * 3, ImageLimits(max_images=2))


def test_local_file_when_allowed(tmp_path):
    p = tmp_path / "x.png"
    p.write_bytes(_png(12, 7))
    a, b = load_images([str(p), f"file://{p}"], ImageLimits(allow_files=True))
    assert a.size == b.size == (12, 7)


def test_extreme_aspect_ratio(tiny):
    img = Image.new("RGB", (402, 2))
    with pytest.raises(VisionError, match=r"image 0: aspect ratio 201.0 of a 402x2 image exceeds 200"):
        preprocess_images([img], PreprocessConfig.from_json(PRE, tiny[1].vision))


def test_chat_image_parts_in_order_and_named():
    png = _b64(_png())
    msgs = [{"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"},
                                         {"type": "image_url", "image_url": {"url": png}},
                                         {"type": "image", "image": "data:image/png;base64,AAAA"}]},
            {"role": "user", "content": [{"type": "image_url", "image_url": "file:///x.png"}]}]
    urls, names = image_urls(msgs)
    assert urls == [png, "data:image/png;base64,AAAA", "file:///x.png"]
    assert names == ["messages.1.content.1.image_url", "messages.1.content.2.image", "messages.2.content.0.image_url"]
    with pytest.raises(VisionError, match=r"messages.0.content.0.image_url.url: expected a non-empty image URL"):
        image_urls([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": ""}}]}])
    with pytest.raises(VisionError, match="messages.1.content.1.image_url: not an image"):
        load_images([_b64(b"nope" * 9)], names=["messages.1.content.1.image_url"])
