"""`ninfer-rt serve`: OpenAI-compatible HTTP server (thin wrapper over ninfer_rt.server.serve.run_server)."""
from __future__ import annotations

import sys

import click

from .cli import main, user_errors
from .kv_limits import DEFAULT_PREFIX_ENTRIES, MIN_KV_TOKENS
from .vision.cli_options import IMAGE_LIMIT_FLAGS, image_limit_options

TEXT_BODY_MIB, VISION_BODY_MIB = 4.0, 32.0     # --max-body-mib defaults (images arrive as base64 data URIs)
VISION_FLAGS = {**IMAGE_LIMIT_FLAGS, "vision_max_tokens": "--vision-max-tokens"}


def vision_settings(enabled: bool, **given):
    """(VisionOptions | None, image tokens per request): --vision and its limits (unset ones keep the
    defaults); a limit without --vision is an error. A server never reads local files as images."""
    from .server.runtime import DEFAULT_VISION_TOKENS, ServeError
    given = {k: v for k, v in given.items() if v is not None}
    if not enabled:
        if given:
            raise ServeError(f"{VISION_FLAGS[next(iter(given))]}: only applies with --vision")
        return None, DEFAULT_VISION_TOKENS
    from .vision.setup import VisionOptions
    budget = given.pop("vision_max_tokens", DEFAULT_VISION_TOKENS)
    return VisionOptions(allow_files=False, **given), budget


def origins(value: str) -> tuple[str, ...]:
    """--allowed-origins: "a,b" or vLLM's JSON list '["a", "b"]'."""
    from .server.runtime import ServeError
    if value.lstrip().startswith("["):
        import json
        try:
            got = json.loads(value)
        except ValueError:
            got = None
        if not isinstance(got, list) or not all(isinstance(o, str) for o in got):
            raise ServeError(f"--allowed-origins {value}: expected a JSON list of strings")
        return tuple(o.strip() for o in got if o.strip())
    return tuple(o.strip() for o in value.split(",") if o.strip())


def speculative_tokens(value: str) -> int:
    """vLLM's --speculative-config for this model's MTP module -> draft tokens per round."""
    import json

    from .server.runtime import ServeError
    try:
        cfg = json.loads(value)
    except ValueError:
        cfg = None
    if not isinstance(cfg, dict):
        raise ServeError(f"--speculative-config {value}: expected a JSON object")
    extra = sorted(set(cfg) - {"method", "num_speculative_tokens"})
    if extra:
        raise ServeError(f"--speculative-config: {extra[0]!r} is not supported (method and "
                         f"num_speculative_tokens are)")
    method, n = cfg.get("method", "mtp"), cfg.get("num_speculative_tokens")
    if not (isinstance(method, str) and (method == "mtp" or method.endswith("_mtp"))):
        raise ServeError(f"--speculative-config: method {method!r}: only the model's own MTP module drafts here "
                         f"(\"mtp\")")
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 7:
        raise ServeError(f"--speculative-config: num_speculative_tokens: expected an integer in 1..7, got {n!r}")
    return n


NAME_FLAGS = ("--served-model-name", "--model-id")


def spread_names(args: list[str]) -> list[str]:
    """vLLM's `--served-model-name a b` (argparse's nargs="+": the names run to the next option) as click's
    repeated `--served-model-name a --served-model-name b` (a click option takes one value)."""
    out, i = [], 0
    while i < len(args):
        a = args[i]
        out.append(a)
        i += 1
        if a == "--":
            return out + args[i:]
        if a in NAME_FLAGS and i < len(args):
            out.append(args[i])
            i += 1
            while i < len(args) and not args[i].startswith("-"):
                out += [a, args[i]]
                i += 1
    return out


class _ServeCommand(click.Command):
    def parse_args(self, ctx, args):
        return super().parse_args(ctx, spread_names(list(args)))


def _kv_capacity(ctx, param, value):
    if value is None or value == "auto":
        return None
    try:
        n = int(value)
    except ValueError:
        raise click.BadParameter(f"expected a number of tokens or 'auto', got {value!r}") from None
    if n < MIN_KV_TOKENS:       # the pool needs two pages (runtime.kv_pages)
        raise click.BadParameter(f"expected at least {MIN_KV_TOKENS} tokens (two KV pages) or 'auto', got {n}")
    return n


@main.command("serve", cls=_ServeCommand)
@click.argument("artifact")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (loopback by default).")
@click.option("--port", default=8080, show_default=True, type=int)
@click.option("--served-model-name", "--model-id", "model_id", multiple=True,
              help="Model names clients may send (default: the folder or repo name); replies carry the first. "
                   "Several: ARTIFACT first, then --served-model-name a b, or the flag repeated.")
@click.option("--chat-template", default=None,
              help="A Jinja chat template (a file, or the template itself) to use instead of the artifact's.")
@click.option("--allowed-origins", default="*", show_default=True,
              help="CORS: origins browsers may call from, comma-separated or a JSON list ('*': any; '': none).")
@click.option("--ssl-keyfile", type=click.Path(dir_okay=False), default=None,
              help="TLS key (HTTPS, with --ssl-certfile).")
@click.option("--ssl-certfile", type=click.Path(dir_okay=False), default=None, help="TLS certificate chain.")
@click.option("--tp", "--tensor-parallel-size", "tp", default=1, show_default=True, type=click.IntRange(1, 8), help="Tensor-parallel ranks.")
@click.option("--spec", type=click.Choice(["none", "mtp"]), default="none", show_default=True,
              help="Speculative decoding with the artifact's MTP module.")
@click.option("--draft-tokens", default=3, show_default=True, type=click.IntRange(1, 7),
              help="MTP draft tokens per round (with --spec mtp).")
@click.option("--speculative-config", default=None,
              help='vLLM\'s JSON form of --spec mtp --draft-tokens N: \'{"method": "mtp", "num_speculative_tokens": N}\' '
                   '(methods named *_mtp too).')
@click.option("--draft-head", default=None, envvar="NINFER_DRAFT_HEAD",
              help="Where MTP drafts get their logits: lm_head, nvfp4 (an NVFP4 copy of the lm_head made "
                   "at load), nvfp4:N (only token ids below N) or auto (nvfp4 where the lm_head allows it); "
                   "verify always uses the lm_head (env NINFER_DRAFT_HEAD). [default: auto]")
@click.option("--max-concurrency", "--max-num-seqs", "max_concurrency", default=4, show_default=True, type=click.IntRange(1, 256),
              help="Sequences batched together (continuous batching slots).")
@click.option("--kv-capacity", default="auto", show_default=True, callback=_kv_capacity,
              help="Tokens in the shared KV pool, or 'auto' (free device memory after weights).")
@click.option("--gpu-memory-utilization", default=None, type=click.FloatRange(0, 1, min_open=True),
              help="vLLM's: the fraction of the GPU's memory this server may hold (weights, graphs, KV); the "
                   "automatic KV size leaves the rest free. [default: all but 1 GiB]")
@click.option("--max-context", "--max-model-len", "max_context", default=None, type=click.IntRange(MIN_KV_TOKENS),
              help=f"Prompt + completion tokens per request (at least {MIN_KV_TOKENS}).")
@click.option("--max-pending", default=64, show_default=True, type=click.IntRange(1),
              help="Queued requests before answering 429.")
@click.option("--default-max-tokens", default=4096, show_default=True, type=click.IntRange(1),
              help="Completion budget of requests that give no max_tokens (capped by the context).")
@click.option("--api-key", default=None, envvar="NINFER_API_KEY",
              help="Require 'Authorization: Bearer KEY' (or 'X-API-Key: KEY') on every route but /health "
                   "(env NINFER_API_KEY).")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default=None,
              help="Default: cuda when a GPU is visible, else cpu.")
@click.option("--dtype", type=click.Choice(["bfloat16", "float16", "float32"]), default=None,
              help="Activation and KV dtype (default: bfloat16 on cuda, float32 on cpu).")
@click.option("--backend", type=click.Choice(["torch", "triton"]), default=None,
              help="Ops backend (default: triton on cuda, torch on cpu).")
@click.option("--prefill-chunk", "--max-num-batched-tokens", "prefill_chunk", default=512, show_default=True, type=click.IntRange(1),
              help="Prompt tokens per engine step (shared by all prefilling requests).")
@click.option("--log-requests", type=click.Path(dir_okay=False, writable=True), default=None,
              help="Append a JSONL record per request (timings, token counts, MTP stats; no text).")
@click.option("--drain-timeout", default=30.0, show_default=True, type=click.FloatRange(0),
              help="Seconds in-flight requests get to finish on SIGTERM.")
@click.option("--max-body-mib", default=None, type=click.FloatRange(0.001),
              help=f"Largest accepted request body (413 beyond). [default: {TEXT_BODY_MIB:g}, "
                   f"{VISION_BODY_MIB:g} with --vision]")
@click.option("--no-verify", is_flag=True, help="Skip the artifact checksum verification at load.")
@click.option("--eager", "--enforce-eager", "eager", is_flag=True, help="Do not capture CUDA graphs (decode/verify/draft steps run eagerly).")
@click.option("--no-async-scheduling", is_flag=True,
              help="Read each decode step's tokens back before launching the next (default on CUDA: launch ahead).")
@click.option("--scheduling-policy", type=click.Choice(["fcfs", "priority"]), default="fcfs", show_default=True,
              help="Queue order (vLLM's): first come first served, or by each request's 'priority' (lower first, "
                   "then arrival; running requests are not preempted). With fcfs a nonzero priority is a 400.")
@click.option("--enable-prefix-caching/--no-enable-prefix-caching", default=True, show_default=True,
              help="Resume prompts that start like an earlier one from its cached KV pages and GDN state (vLLM's).")
@click.option("--prefix-cache-entries", default=DEFAULT_PREFIX_ENTRIES, show_default=True, type=click.IntRange(1),
              help="Prompt prefixes kept (least recently used go first; each holds a copy of the GDN state).")
@click.option("--vision", is_flag=True,
              help="Accept image_url parts (data:image/...;base64 URIs) in chat messages; loads the vision tower. "
                   "Without it the tower stays in the file and image requests get a 400.")
@click.option("--vision-max-tokens", type=click.IntRange(1),
              help="Image tokens per request at most (--vision); more is a 400. [default: 4096]")
@image_limit_options("request")
@user_errors
def serve(artifact, host, port, model_id, chat_template, allowed_origins, ssl_keyfile, ssl_certfile, tp, spec,
          draft_tokens, speculative_config, draft_head, max_concurrency, kv_capacity, max_context, max_pending, default_max_tokens,
          api_key, device, dtype, backend, prefill_chunk, log_requests, drain_timeout, max_body_mib, no_verify, eager,
          no_async_scheduling, scheduling_policy, gpu_memory_utilization, enable_prefix_caching, prefix_cache_entries, vision, vision_max_tokens, max_images,
          max_image_bytes, max_image_pixels, vision_max_pixels):
    """Serve ARTIFACT_DIR (or hf://ORG/REPO[@REVISION]) over an OpenAI-compatible HTTP API."""
    from .server.runtime import RuntimeOptions
    from .server.serve import ServeOptions, run_server
    from .tokenizer import read_template
    vis, vision_tokens = vision_settings(vision, max_images=max_images, max_image_bytes=max_image_bytes,
                                         max_image_pixels=max_image_pixels, max_pixels=vision_max_pixels,
                                         vision_max_tokens=vision_max_tokens)
    from .draft_head import use as use_draft_head
    use_draft_head(draft_head)
    if speculative_config is not None:
        spec, draft_tokens = "mtp", speculative_tokens(speculative_config)
    if max_body_mib is None:
        max_body_mib = VISION_BODY_MIB if vis is not None else TEXT_BODY_MIB
    if device is None:
        import torch
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = dtype or ("bfloat16" if device == "cuda" else "float32")
    backend = backend or ("triton" if device == "cuda" else "torch")
    rt = RuntimeOptions(artifact=artifact, tp=tp, device=device, dtype=dtype, backend=backend,
                        draft_tokens=draft_tokens if spec == "mtp" else 0, max_concurrency=max_concurrency,
                        kv_capacity=kv_capacity, max_context=max_context, verify=not no_verify,
                        prefill_chunk=prefill_chunk, vision=vis, vision_max_tokens=vision_tokens, eager=eager,
                        async_scheduling=False if no_async_scheduling else None,
                        prefix_cache=prefix_cache_entries if enable_prefix_caching else 0,
                        gpu_memory_utilization=gpu_memory_utilization,
                        chat_template=read_template(chat_template) if chat_template else None)
    opts = ServeOptions(runtime=rt, host=host, port=port, model_id=model_id[0] if model_id else None,
                        aliases=tuple(model_id[1:]), max_pending=max_pending,
                        api_key=api_key, log_requests=log_requests, drain_timeout_s=drain_timeout,
                        max_body_bytes=int(max_body_mib * (1 << 20)), default_max_tokens=default_max_tokens,
                        allowed_origins=origins(allowed_origins),
                        ssl_keyfile=ssl_keyfile, ssl_certfile=ssl_certfile, scheduling_policy=scheduling_policy)
    sys.exit(run_server(opts))
