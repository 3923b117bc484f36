"""Inputs shared by the f16-variant GEMV tests (packed-half2, warp-MMA): NVFP4 and GGML weights, wide-range
activations, one warp-MMA case check; `as_h200`, the launcher seen as on an H200 for candidate-list tests
without a GPU; and `run_kernel`, a weight's format GEMV called directly."""
import numpy as np
import torch

from ninfer_formats import codecs


def rel_l2(a, b) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def nvfp4_weights(N: int, K: int, seed: int, dev):
    """(codes, scales, gscale) of N(0, 0.05) weights quantized by the numpy codec, codes/scales on `dev`."""
    w = np.random.default_rng(seed).standard_normal((N, K)).astype(np.float32) * 0.05
    c, s, g = codecs.nvfp4.quantize(w)
    return torch.from_numpy(c).to(dev), torch.from_numpy(s).to(dev), float(g)


def codec_blocks(fmt: str, N: int, K: int, seed: int, dev) -> torch.Tensor:
    """GGML blocks (q6_k / iq3_s) of N(0, 0.05) weights quantized by the numpy codec, on `dev`."""
    w = np.random.default_rng(seed).standard_normal((N, K)).astype(np.float32) * 0.05
    return torch.from_numpy(codecs.quantize(fmt, w)).to(dev)


GGML_BLOCK = {"q6_k": (210, 208), "iq3_s": (110, 0)}   # bytes per 256 weights, offset of the fp16 scale d


def random_ggml_blocks(fmt: str, N: int, K: int, seed: int, dev="cpu") -> torch.Tensor:
    """Random block bytes with d in [1e-3, 1e-2] (quantizing 27B-sized rows with the codec is slow)."""
    nbytes, at = GGML_BLOCK[fmt]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (N, K // 256, nbytes), dtype=np.uint8)
    raw[..., at:at + 2] = rng.uniform(1e-3, 1e-2, (N, K // 256)).astype(np.float16).view(np.uint8).reshape(N, -1, 2)
    return torch.from_numpy(raw.reshape(N, -1)).to(dev)


def iq3_s_every_index_blocks(rows: int, dev) -> torch.Tensor:
    """One IQ3_S block per row (d = 0.37): grid index 64 r + i (mod 512) at 4-weight group i (qs byte + qh bit),
    random signs, sub-block scale nibbles cycling through 0..15."""
    raw = np.zeros((rows, 110), np.uint8)
    idx = np.arange(rows * 64) % 512
    raw[:, 0:2] = np.frombuffer(np.float16(0.37).tobytes(), np.uint8)
    raw[:, 2:66] = (idx & 0xFF).reshape(rows, 64)
    raw[:, 66:74] = ((idx >> 8).reshape(rows, 8, 8) << np.arange(8)).sum(-1)    # qh byte b, bit j: group 8b + j
    raw[:, 74:106] = np.random.default_rng(0).integers(0, 256, (rows, 32))
    raw[:, 106:110] = (np.arange(rows * 4).reshape(rows, 4) * 0x53) & 0xFF
    return torch.from_numpy(raw).to(dev)


def tuner_tiles(tiles: dict, N: int, K: int, device, **variant) -> list:
    """GemvConfig of every tile in a {T bucket: tiles} table at [N, K] (16-weight groups), with the split-K the tuner
    would give it on `device`; variant: h2=True or mma=True."""
    from ninfer_kernels import gemv_launch as gl
    from ninfer_kernels.gemv_launch import GemvConfig
    return [GemvConfig(bn, bg, nw, st, split=gl.auto_split(-(-N // bn), K // 16 // bg, gl.sm_count(device)), **variant)
            for bn, bg, nw, st in sorted({tile for ts in tiles.values() for tile in ts})]


def ggml_mma(fmt: str, gemv, repack, ref, dev):
    """`check_mma_case`'s weight maker for a GGML format: codec blocks, repacked for `gemv`, checked by `ref`."""
    def make(N: int, K: int, seed: int):
        blocks = codec_blocks(fmt, N, K, seed, dev)
        planes = repack(blocks, K)
        return (lambda x, out, res, cfg: gemv(x, planes, out, res, config=cfg),
                lambda x, res: ref(x, blocks, residual=res))
    return make


def nvfp4_mma(dev):
    """`check_mma_case`'s weight maker for NVFP4 (codec-quantized weights in the kernels' chunk-major planes)."""
    from ninfer_kernels.gemv_nvfp4 import gemv_nvfp4, repack_nvfp4
    from ninfer_kernels.reference import ref_nvfp4

    def make(N: int, K: int, seed: int):
        codes, scales, gs = nvfp4_weights(N, K, seed, dev)
        planes = repack_nvfp4(codes, scales)
        return (lambda x, out, res, cfg: gemv_nvfp4(x, planes, gs, out, res, config=cfg),
                lambda x, res: ref_nvfp4(x, codes, scales, gs, residual=res))
    return make


def check_mma_case(case: tuple, make, rtol_f32: float, rtol_half: float, dev) -> None:
    """One warp-MMA GEMV case -- (T, dtype, N, K, block_n, block_g, num_warps, num_stages, split, residual) --
    against the codec reference, into a NaN-poisoned output; with K splits the result is deterministic and the
    split counters are back at zero. make(N, K, seed) -> (gemv(x, out, res, cfg), ref(x, res)): `ggml_mma`,
    `nvfp4_mma`."""
    from ninfer_kernels.gemv_launch import GemvConfig, workspace
    T, dtype, N, K, bn, bg, nw, stages, split, has_res = case
    gemv, ref = make(N, K, T)
    x = (wide_range_x(T, K, seed=T) if dtype != torch.float16 else torch.randn(T, K) * 30).to(dtype).to(dev)
    res = torch.randn(T, N).to(dtype).to(dev) if has_res else None
    cfg = GemvConfig(bn, bg, nw, stages, split=split, mma=True)
    y = gemv(x, torch.full((T, N), float("nan"), dtype=dtype, device=dev), res, cfg)
    assert torch.isfinite(y).all()
    assert rel_l2(y, ref(x, res)) < (rtol_f32 if dtype == torch.float32 else rtol_half)
    if split > 1:
        assert torch.equal(gemv(x, None, res, cfg), y)
        assert int(workspace(x.device, 0, 0)[1].abs().sum()) == 0


def wide_range_x(T: int, K: int, seed: int) -> torch.Tensor:
    """N(0,1) times 2**u, u uniform in [-20, 12] per element: tiny and large activations side by side."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, K, generator=g) * torch.exp2(torch.randint(-20, 13, (T, K), generator=g).float())


def prepared_inputs(T: int, K: int, N: int, has_res: bool, dev):
    """(x, residual or None, NaN-poisoned out), bf16, for a GEMV on prepared activations: `wide_range_x`, with an
    all-zero 128-chunk in the first row and a huge one (activations 256..383) in the last."""
    x = wide_range_x(T, K, seed=T)
    x[0, :128] = 0.0
    x[-1, 256:384] *= 1e30
    res = torch.randn(T, N).to(torch.bfloat16).to(dev) if has_res else None
    return x.to(torch.bfloat16).to(dev), res, torch.full((T, N), float("nan"), dtype=torch.bfloat16, device=dev)


def every_code_nvfp4(N: int, K: int, dev):
    """(codes, scales): every code byte at every position; E4M3 scales from subnormal (0x01, 0x07) to 448 (0x7E)."""
    codes = torch.from_numpy((np.arange(N * K // 2) % 256).astype(np.uint8).reshape(N, K // 2)).to(dev)
    pattern = np.array([0x01, 0x07, 0x08, 0x38, 0x7E, 0x30, 0x40, 0x50], dtype=np.uint8)
    return codes, torch.from_numpy(np.resize(pattern, (N, K // 16))).to(dev)


def extreme_x(K: int, span: int, dev) -> torch.Tensor:
    """[2, K] fp32 with four spans of `span` activations: all zero, near the fp32 top, fp32 subnormals (row 0)
    and beyond the f16 range (row 1) -- what a power-of-two scaling into f16 must survive."""
    x = torch.randn(2, K, dtype=torch.float32, generator=torch.Generator().manual_seed(0))
    x[0, 0:span] = 0.0
    x[0, span:2 * span] *= 1e30
    x[0, 2 * span:3 * span] *= 1e-40
    x[1, 3 * span:4 * span] = 65504.0 * 4
    return x.to(dev)


def fake_cuda(monkeypatch, cc: tuple = (9, 0), sms: int = 132) -> torch.device:
    """`gemv_tiles.candidates` (and the launcher) as on a CUDA device of capability `cc` with `sms` SMs, without
    one: returns the cuda device to pass."""
    from ninfer_kernels import gemv_launch as gl, gemv_tiles as gt
    for mod in (gl, gt):
        monkeypatch.setattr(mod, "interpreting", lambda: False)
        monkeypatch.setattr(mod, "sm_count", lambda device: sms)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cc)
    return torch.device("cuda")


def as_h200(monkeypatch) -> torch.device:
    """`fake_cuda` for an H200 (sm_90, 132 SMs)."""
    return fake_cuda(monkeypatch)


def run_kernel(qw, x, out=None, residual=None, config=None):
    """The format's GEMV entry point called directly (dispatch.linear is tested separately)."""
    from ninfer_kernels.gemv_f8 import gemv_f8
    from ninfer_kernels.gemv_iq3_s import gemv_iq3_s, repack_iq3_s
    from ninfer_kernels.gemv_nvfp4 import gemv_nvfp4, repack_nvfp4
    from ninfer_kernels.gemv_plain import gemv_plain
    from ninfer_kernels.gemv_q6_k import gemv_q6_k, repack_q6_k
    d = qw.data
    if qw.fmt == "nvfp4":
        return gemv_nvfp4(x, repack_nvfp4(d["codes"], d["scales"]), d["gscale"], out, residual, config=config)
    if qw.fmt == "q6_k":
        return gemv_q6_k(x, repack_q6_k(qw.blocks(), qw.shape[1]), out, residual, config=config)
    if qw.fmt == "iq3_s":
        return gemv_iq3_s(x, repack_iq3_s(qw.blocks(), qw.shape[1]), out, residual, config=config)
    if qw.fmt == "f8_e4m3_row":
        return gemv_f8(x, d["codes"], d["row_scale"], out, residual, config=config)
    return gemv_plain(x, d["w"], out, residual, config=config)
