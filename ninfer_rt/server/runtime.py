"""Build the serving Engine from command-line options: load, size the KV pool, start TP followers.

KV sizing (`--kv-capacity auto`): on CUDA, the free device memory after the weights are placed, minus a
headroom (1 GiB + the GDN states of every slot + the speculative snapshot buffers + a prefill workspace +
with `--vision` the tower's activations for a request at the image-token budget), divided by the KV bytes
of one token; with TP every rank measures and the smallest answer wins. On CPU a fixed default. Either way
it is capped at max_concurrency x max_context: more could never be used.

Vision (`RuntimeOptions.vision`): rank 0 binds the tower's `visual.*` weights at load, before the KV pool
is sized; the other ranks never hold them (they receive the merged embeddings with each image prompt).

Grad mode is never switched globally here: loading runs under `torch.no_grad()`, and the Engine turns it
off inside its own calls (grad mode is per thread).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ninfer_formats.errors import NinferError

from ..kv_limits import DEFAULT_PREFIX_ENTRIES, MIN_KV_TOKENS, PAGE_SIZE

if TYPE_CHECKING:
    from ..vision.setup import VisionOptions

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_KV_TOKENS = 32768
HEADROOM_BYTES = 1 << 30
DEFAULT_CONTEXT = 8192
DEFAULT_VISION_TOKENS = 4096        # image tokens per request (--vision-max-tokens)


class ServeError(NinferError):
    """The serving options are inconsistent with each other or with the artifact."""


@dataclass(frozen=True)
class RuntimeOptions:
    artifact: str                       # local folder or rank-0 file
    tp: int = 1
    device: str = "cpu"
    dtype: str = "float32"
    backend: str = "torch"
    draft_tokens: int = 0               # 0 = no speculative decoding
    max_concurrency: int = 4
    kv_capacity: int | None = None      # tokens; None = auto
    max_context: int | None = None      # None = min(model limit, DEFAULT_CONTEXT)
    verify: bool = True
    prefill_chunk: int = 512
    vision: VisionOptions | None = None # None: text only, the tower stays in the file
    vision_max_tokens: int = DEFAULT_VISION_TOKENS   # image tokens per request (with vision)
    eager: bool = False                 # no CUDA-graph capture (the runner's steps run eagerly; --eager)
    async_scheduling: bool | None = None   # run-ahead decode steps; None = on CUDA (--no-async-scheduling)
    chat_template: tuple[str, str] | None = None    # (its name, its text): replaces the artifact's (--chat-template)
    prefix_cache: int = DEFAULT_PREFIX_ENTRIES   # prompt prefixes kept for prompts that start alike; 0 = off
    gpu_memory_utilization: float | None = None  # vLLM's: with an auto KV size, leave (1 - this) of the GPU free

    def __post_init__(self):
        if self.device not in ("cpu", "cuda"):
            raise ServeError(f"--device: expected cpu or cuda, got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ServeError(f"--dtype: expected one of {', '.join(DTYPES)}, got {self.dtype!r}")
        for name in ("tp", "max_concurrency", "prefill_chunk", "vision_max_tokens"):
            if getattr(self, name) < 1:
                raise ServeError(f"--{name.replace('_', '-')}: expected a positive integer, got {getattr(self, name)}")
        if self.prefix_cache < 0:
            raise ServeError(f"--prefix-cache-entries: expected 0 (off) or more, got {self.prefix_cache}")
        u = self.gpu_memory_utilization
        if u is not None and not 0 < u <= 1:
            raise ServeError(f"--gpu-memory-utilization: expected a fraction in (0, 1], got {u}")
        if u is not None and self.kv_capacity is not None:
            raise ServeError("--gpu-memory-utilization sizes the KV cache from device memory; --kv-capacity sets "
                             "it: give one of them")
        for name in ("kv_capacity", "max_context"):
            v = getattr(self, name)
            if v is not None and v < MIN_KV_TOKENS:
                raise ServeError(f"--{name.replace('_', '-')}: expected at least {MIN_KV_TOKENS} tokens "
                                 f"(two KV pages), got {v}")
        if self.vision is not None:
            from ..vision.setup import VisionOptions
            if not isinstance(self.vision, VisionOptions):
                raise ServeError(f"vision: expected VisionOptions, got {type(self.vision).__name__}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ServeError("--device cuda: no CUDA device is visible")


@dataclass
class Runtime:
    engine: object
    loaded: object
    tokenizer: object
    max_context: int
    launch: object = None               # tp.Launch with TP > 1
    vision: object = None               # VisionRuntime (rank 0) when serving with vision

    def close(self) -> None:
        released = False            # the followers were told to stop (else they sit in a step's collective)
        try:
            usable = self.engine.usable
            self.engine.shutdown()
            released = usable
        finally:
            if self.launch is not None:
                self.launch.close(released=released)
            self.loaded.close()


def kv_bytes_per_token(cfg, tp: int, dtype: torch.dtype) -> int:
    n_kv = sum(cfg.is_full(i) for i in range(cfg.num_hidden_layers)) + (cfg.mtp_num_hidden_layers > 0)
    return 2 * n_kv * (cfg.num_key_value_heads // tp) * cfg.head_dim * torch.empty((), dtype=dtype).element_size()


def gdn_bytes_per_slot(cfg, tp: int) -> int:
    n_gdn = sum(not cfg.is_full(i) for i in range(cfg.num_hidden_layers))
    per = (cfg.linear_conv_kernel_dim - 1) * (cfg.conv_dim // tp) + \
        (cfg.linear_num_value_heads // tp) * cfg.linear_key_head_dim * cfg.linear_value_head_dim
    return 4 * n_gdn * per


def model_context(cfg, opts: RuntimeOptions) -> int:
    limit = cfg.max_position_embeddings
    if opts.max_context is not None and opts.max_context > limit:
        raise ServeError(f"--max-context {opts.max_context}: the model supports at most {limit} positions")
    return opts.max_context or min(limit, DEFAULT_CONTEXT)


def auto_kv_tokens(cfg, opts: RuntimeOptions, device: torch.device, growth: int = 0) -> int:
    """This rank's KV capacity in tokens for `--kv-capacity auto` (weights already on the device; `growth`: the
    bytes their load-time repacks will add, `Ops.repack_growth`)."""
    if device.type != "cuda":
        return CPU_KV_TOKENS
    free, total = torch.cuda.mem_get_info(device)
    u = opts.gpu_memory_utilization
    # vLLM's fraction of the whole device: what this process may hold in all, so the rest stays free
    headroom = HEADROOM_BYTES if u is None else max(int((1 - u) * total), HEADROOM_BYTES)
    slot = gdn_bytes_per_slot(cfg, opts.tp)
    snapshots = opts.max_concurrency * (opts.draft_tokens + 1) * slot if opts.draft_tokens else 0
    workspace = opts.prefill_chunk * (cfg.intermediate_size // opts.tp + 4 * cfg.hidden_size) * 4 * 4
    slots = opts.max_concurrency + 1 + opts.prefix_cache   # + the graph runner's scratch slot, the cached states
    budget = free - headroom - growth - slots * slot - snapshots - workspace - \
        vision_workspace_bytes(cfg, opts)
    return max(0, budget // kv_bytes_per_token(cfg, opts.tp, DTYPES[opts.dtype]))


def vision_workspace_bytes(cfg, opts: RuntimeOptions) -> int:
    """Transient memory of one tower run at the image-token budget (rank 0 only runs it; with TP the
    smallest rank answer wins, so rank 0's is the one that counts). Per patch row: the fp32 pixels, the
    residual stream with its fp32 LayerNorm / qkv / attention copies (~8 x hidden) and the MLP (~2 x
    intermediate), all at 4 bytes; the attention kernels on CUDA keep no [s, s] matrix."""
    v = cfg.vision
    if opts.vision is None or v is None:
        return 0
    patches = opts.vision_max_tokens * v.spatial_merge_size ** 2
    patch_dim = v.in_channels * v.temporal_patch_size * v.patch_size ** 2
    return patches * (patch_dim + 8 * v.hidden_size + 2 * v.intermediate_size) * 4


def kv_pages(cfg, opts: RuntimeOptions, device: torch.device, group, growth: int = 0) -> int:
    """Pages of the shared pool; the same number on every rank."""
    ctx = model_context(cfg, opts)
    tokens = opts.kv_capacity if opts.kv_capacity is not None else auto_kv_tokens(cfg, opts, device, growth)
    if group is not None and group.size > 1:
        tokens = min(group.all_gather_object(tokens))
    tokens = min(tokens, opts.max_concurrency * ctx)
    if tokens < MIN_KV_TOKENS:
        raise ServeError(f"KV cache: only {tokens} tokens fit (context {ctx}); free device memory, raise "
                         f"--kv-capacity, --gpu-memory-utilization or --max-context, or lower --max-concurrency / "
                         f"--draft-tokens")
    return tokens // PAGE_SIZE


def _load(opts: RuntimeOptions, rank: int, device: torch.device):
    from ..backends import get_ops
    from ..loader import load
    loaded = load(opts.artifact, rank=rank, tp_size=opts.tp, verify=opts.verify, device=device,
                  dtype=DTYPES[opts.dtype], vision=opts.vision is not None and rank == 0)
    return loaded, get_ops(opts.backend)


def _spec(opts: RuntimeOptions):
    if not opts.draft_tokens:
        return None
    from ..speculative import SpecConfig
    return SpecConfig(num_draft_tokens=opts.draft_tokens)


def _phase(group, fn):
    """Run fn on every rank; with TP, every rank raises if any rank failed (no rank is left in a collective)."""
    if group is None or group.size == 1:
        return fn()
    from ..tp import agree
    out, err = None, None
    try:
        out = fn()
    except (NinferError, OSError, torch.OutOfMemoryError) as e:
        err = str(e)
    agree(group, err)
    return out


def _build(opts: RuntimeOptions, group, device, make):
    """load -> agree -> size the pool (collective) -> make(loaded, ops, pages) -> agree. No autograd state is
    built on the way; the caller's grad mode is restored afterwards."""
    rank = group.rank if group is not None else 0
    with torch.no_grad():
        loaded, ops = _phase(group, lambda: _load(opts, rank, device))
        pages = kv_pages(loaded.config, opts, device, group, ops.repack_growth(loaded.weights))
        return loaded, pages, _phase(group, lambda: make(loaded, ops, pages))


def _graphs(opts: RuntimeOptions) -> str:
    return "eager" if opts.eager else "auto"


def follower_main(group, opts: RuntimeOptions) -> None:
    """Rank r > 0 (spawned by tp.launch): load the shard, then mirror rank 0's steps until told to stop.
    Its layout (cache, graphs) comes from the same arguments as rank 0's Engine, so the captures match."""
    from ..engine import engine_layout
    from ..engine_follower import Follower

    def make(loaded, ops, pages):
        lay = engine_layout(loaded, ops, _spec(opts), opts.max_concurrency, pages, PAGE_SIZE,
                            model_context(loaded.config, opts), _graphs(opts))
        return Follower(loaded, ops, group, _spec(opts), lay.cache, graphs=lay.graphs, prefix_cache=opts.prefix_cache)
    _, _, follower = _build(opts, group, group.device, make)
    follower.run()


def open_runtime(opts: RuntimeOptions) -> Runtime:
    """Rank 0: launch followers (TP > 1), load, size the pool, build the Engine and the tokenizer."""
    from ..engine import Engine
    from ..tokenizer import Tokenizer
    from ..tp import launch, rank_device
    lch = launch(opts.tp, follower_main, (opts,), device=opts.device) if opts.tp > 1 else None
    group = lch.group if lch is not None else None

    def make(loaded, ops, pages):
        vis = _vision(loaded, ops, opts)
        tok = Tokenizer.from_resources(loaded.resources, eos_token_ids=loaded.config.eos_token_ids)
        if opts.chat_template is not None:
            tok.use_template(opts.chat_template[1], opts.chat_template[0])
        engine = Engine(loaded, ops, group, _spec(opts), max_batch=opts.max_concurrency, kv_pages=pages,
                        page_size=PAGE_SIZE, max_model_len=model_context(loaded.config, opts),
                        prefill_chunk=opts.prefill_chunk, vision=vis, graphs=_graphs(opts),
                        async_scheduling=opts.async_scheduling, grammar_tokenizer=tok, prefix_cache=opts.prefix_cache)
        return engine, tok, vis
    try:
        loaded, pages, (engine, tok, vis) = _build(opts, group, rank_device(opts.device, 0), make)
    except BaseException as e:
        if lch is not None:     # an agreed load error ends the followers by itself; an interrupt does not
            lch.close(timeout_s=10, released=not isinstance(e, KeyboardInterrupt))
        raise
    print(f"ninfer-rt: KV pool {pages} pages x {PAGE_SIZE} tokens, context {engine.max_model_len}, "
          f"{opts.max_concurrency} slots, tp {opts.tp}" + (", vision" if vis is not None else "") +
          (f", prefix cache {opts.prefix_cache} entries" if opts.prefix_cache else "") +
          _graph_note(engine), file=sys.stderr)
    return Runtime(engine, loaded, tok, engine.max_model_len, lch, vis)


def _graph_note(engine) -> str:
    g = engine.graphs
    if g is None:
        return ", no CUDA graphs"
    if g.cfg.eager:
        return ", CUDA graphs off (--eager)"
    return f", {g.stats.captured} CUDA graphs captured in {g.stats.capture_s:.1f} s"


def _vision(loaded, ops, opts: RuntimeOptions):
    """Rank 0's VisionRuntime (the tower was bound by load(vision=True)); None without vision."""
    if opts.vision is None:
        return None
    from ..vision.setup import build_vision_runtime
    return build_vision_runtime(loaded, ops, opts.vision, dtype=DTYPES[opts.dtype])


HF_SCHEME = "hf://"


def default_model_id(spec: str) -> str:
    """ORG/REPO for hf://ORG/REPO[@REV], else the artifact folder's (or file's) name."""
    import os
    if spec.startswith(HF_SCHEME):
        return spec[len(HF_SCHEME):].partition("@")[0]
    return os.path.basename(os.path.normpath(spec))


def resolve_artifact(spec: str, verify: bool = True) -> tuple[str, bool]:
    """-> (local folder or file, downloaded). `hf://ORG/REPO[@REVISION]` is fetched with huggingface_hub
    and, unless verify is off, every rank file is checked (checksums, complete TP set) before use."""
    if not spec.startswith(HF_SCHEME):
        from ..loader import find_rank_file
        find_rank_file(spec)                # fails fast: no such folder / no rank files
        return spec, False
    repo, _, rev = spec[len(HF_SCHEME):].partition("@")
    if repo.count("/") != 1 or not all(repo.split("/")):
        raise ServeError(f"{spec}: expected hf://ORG/REPO[@REVISION]")
    from huggingface_hub import snapshot_download
    try:
        path = snapshot_download(repo_id=repo, revision=rev or None)
    except Exception as e:    # hub errors come in many types; all mean "cannot get this artifact"
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ServeError(f"{spec}: cannot download from the Hugging Face Hub: {first}") from None
    if verify:
        from ninfer_formats.container import verify_paths
        problems = verify_paths([path])
        if problems:
            raise ServeError(f"{spec}: downloaded artifact failed verification: {problems[0]}")
    return path, True
