"""`ninfer-rt generate`: one prompt through the engine; text to stdout, timings and MTP stats to stderr.

Sampling defaults come from the artifact's generation_config.json (greedy when it does not sample);
any --temperature/--top-k/--top-p/--min-p given on the command line wins.

Images: with `--vision`, `--messages FILE` may hold OpenAI `image_url` parts (data URIs or local paths,
relative ones taken from FILE's folder); they are read and checked against the limits before the model
loads, and only then is the tower bound on the device. Without `--vision` the tower stays in the file.
"""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import click

from ninfer_formats.errors import NinferError
from ninfer_formats.atomic import write_json_atomic

from .cli import main, user_errors
from .kv_limits import MIN_KV_TOKENS
from .vision.cli_options import IMAGE_LIMIT_FLAGS, image_limit_options

if TYPE_CHECKING:
    from .vision.setup import VisionOptions


class GenerateError(NinferError):
    """The generate command's input (prompt source, messages file, options) is unusable."""


@dataclass(frozen=True)
class GenerateOptions:
    artifact: str
    prompt: str | None = None
    messages: str | None = None          # path of a JSON list of chat messages
    raw: str | None = None
    max_new: int = 128
    draft_tokens: int = 0                # 0 = no speculative decoding
    tp: int = 1
    device: str = "cpu"
    dtype: str = "float32"
    backend: str = "torch"
    verify: bool = True
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None   # None: generation_config.json's (HF applies it greedy or not)
    seed: int | None = None
    thinking: bool = True
    max_context: int | None = None
    stats_json: str | None = None
    vision: VisionOptions | None = None  # None: images are refused and the tower is not loaded
    eager: bool = False                  # no CUDA-graph capture
    async_scheduling: bool | None = None  # run-ahead decode steps; None = on CUDA
    structured: tuple = ()               # SamplingParams.structured (--json-schema / --regex / --grammar-file)

    def __post_init__(self):
        given = [n for n in ("prompt", "messages", "raw") if getattr(self, n) is not None]
        if len(given) != 1:
            raise GenerateError("give exactly one of --prompt, --messages, --raw"
                                + (f" (got {', '.join('--' + g for g in given)})" if given else ""))
        if self.raw == "":              # no chat template around it: nothing to prefill (found before the load)
            raise GenerateError("--raw: empty text; the model needs at least one prompt token")
        from .tokenizer import text_problem
        for name in ("prompt", "raw"):  # found now, not as a TypeError in the tokenizer after the load
            why = getattr(self, name) is not None and text_problem(getattr(self, name))
            if why:
                raise GenerateError(f"--{name}: {why}")
        if self.max_context is not None and self.max_context < MIN_KV_TOKENS:
            raise GenerateError(f"--max-context: expected at least {MIN_KV_TOKENS} tokens (two KV pages), "
                                f"got {self.max_context}")
        if self.stats_json is not None:
            check_output_path("--stats-json", self.stats_json)


def _read_messages(path: str) -> list[dict]:
    try:
        with open(path, encoding="utf-8") as f:
            msgs = json.load(f)
    except ValueError as e:
        raise GenerateError(f"{path}: not valid JSON ({e})") from None
    if isinstance(msgs, dict) and "messages" in msgs:
        msgs = msgs["messages"]
    if not isinstance(msgs, list) or not msgs:
        raise GenerateError(f"{path}: expected a non-empty JSON list of messages")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or \
                not isinstance(m.get("content"), (str, list)):
            raise GenerateError(f"{path}: message {i}: expected an object with string 'role' and 'content'")
        if isinstance(m["content"], list):
            for j, part in enumerate(m["content"]):
                _check_part(f"{path}: messages.{i}.content.{j}", part)
    from .tokenizer import first_text_problem
    bad = first_text_problem(msgs, "messages")
    if bad is not None:
        raise GenerateError(f"{path}: {bad[0]}: {bad[1]}")
    return msgs


def check_output_path(flag: str, path: str) -> None:
    """Before the (slow) run: the file can be written where asked (its folder exists and is writable, and
    the path is not a folder), so the results are not lost at the end."""
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise GenerateError(f"{flag} {path}: is a directory, expected a file path")
    if not os.path.isdir(parent):
        what = "is not a directory" if os.path.exists(parent) else "does not exist"
        raise GenerateError(f"{flag} {path}: parent folder {parent} {what}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise GenerateError(f"{flag} {path}: parent folder {parent} is not writable")


def _check_part(where: str, part) -> None:
    """A content part the chat template would otherwise render wrongly or drop without a word."""
    from .vision.chat_parts import IMAGE_TYPES
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise GenerateError(f"{where}.text: expected a string, got {part.get('text')!r}")
    elif kind not in IMAGE_TYPES:      # image parts are checked by read_images (URL shape, limits)
        raise GenerateError(f"{where}: expected an object with 'type' text, {' or '.join(IMAGE_TYPES)}, "
                            f"got {part!r:.80}")


def _resolve(url: str, folder: str) -> str:
    """Relative local paths are taken from the messages file's folder (data URIs etc. pass through)."""
    u = url.strip()
    if u.lower().startswith(("data:", "http://", "https://", "file://")) or os.path.isabs(u):
        return u
    return os.path.join(folder, u)


def read_images(opts: GenerateOptions, msgs: list[dict] | None) -> tuple[list, list[str]]:
    """The images of the messages file, decoded and within the limits -> (images, names for errors)."""
    from .vision import image_urls, load_images
    if not msgs:
        return [], []
    urls, names = image_urls(msgs)
    if not urls:
        return [], []
    names = [f"{opts.messages}: {n}" for n in names]
    if opts.vision is None:
        raise GenerateError(f"{names[0]}: the messages hold {len(urls)} image(s); pass --vision to use the "
                            "artifact's vision tower")
    folder = os.path.dirname(os.path.abspath(opts.messages))
    return load_images([_resolve(u, folder) for u in urls], opts.vision.limits(), names), names


def prompt_ids(opts: GenerateOptions, tok, msgs: list[dict] | None) -> list[int]:
    if opts.raw is not None:
        return tok.encode(opts.raw)
    kw = {} if opts.thinking else {"enable_thinking": False}
    return tok.encode(tok.render_chat(msgs, add_generation_prompt=True, **kw))


def sampling_params(opts: GenerateOptions, generation_config: dict, stop_ids):
    from .sampling import SamplingParams
    sample = bool(generation_config.get("do_sample", False))

    def pick(value, key, off):
        if value is not None:
            return value
        v = generation_config.get(key, off) if sample else off
        if isinstance(v, bool) or not isinstance(v, (int, float)):     # float("x") / int(None) would traceback
            raise GenerateError(f"resource generation_config.json: {key}: expected a number, got {v!r}")
        return v

    temp = pick(opts.temperature, "temperature", 0.0 if not sample else 1.0)
    rep = opts.repetition_penalty
    if rep is None:                 # HF's generate applies it whether or not it samples
        rep = generation_config.get("repetition_penalty")
        rep = 1.0 if rep is None else rep                  # HF: null is off
        if isinstance(rep, bool) or not isinstance(rep, (int, float)):
            raise GenerateError(f"resource generation_config.json: repetition_penalty: expected a number, got {rep!r}")
    return SamplingParams(temperature=float(temp), top_k=int(pick(opts.top_k, "top_k", 0)),
                          top_p=float(pick(opts.top_p, "top_p", 1.0)), min_p=float(pick(opts.min_p, "min_p", 0.0)),
                          presence_penalty=opts.presence_penalty, frequency_penalty=opts.frequency_penalty,
                          repetition_penalty=float(rep), seed=opts.seed, max_tokens=opts.max_new,
                          stop_token_ids=tuple(sorted(stop_ids)), structured=opts.structured)


def structured_flag(json_schema: str | None, regex: str | None, grammar_file: str | None) -> tuple:
    """--json-schema (text or @FILE) / --regex / --grammar-file -> SamplingParams.structured; at most one."""
    given = [(n, v) for n, v in (("json-schema", json_schema), ("regex", regex), ("grammar-file", grammar_file))
             if v is not None]
    if len(given) > 1:
        raise GenerateError(f"--{given[1][0]}: cannot be combined with --{given[0][0]}")
    if not given:
        return ()
    name, v = given[0]
    spec = _structured_spec(name, v)
    from .grammar import GrammarError, check_syntax
    try:
        check_syntax(spec)
    except GrammarError as e:
        raise GenerateError(f"--{name}: {e}") from None
    return spec


def _structured_spec(name: str, v: str) -> tuple:
    if not v:
        raise GenerateError(f"--{name}: empty")
    if name == "regex":
        return ("regex", v)
    path = v[1:] if name == "json-schema" and v.startswith("@") else (v if name == "grammar-file" else None)
    try:
        text = open(path, encoding="utf-8").read() if path is not None else v
    except (OSError, UnicodeDecodeError) as e:
        raise GenerateError(f"--{name} {path}: cannot read: {getattr(e, 'strerror', None) or e}") from None
    if name == "grammar-file":
        return ("grammar", text)
    try:
        json.loads(text)
    except ValueError as e:
        raise GenerateError(f"--json-schema: not JSON ({e})") from None
    return ("json_schema", text)


def run_generate(opts: GenerateOptions, out=None, log=None) -> dict:
    """Generate; stream text to `out`; return the stats (also written to opts.stats_json)."""
    from .server.runtime import RuntimeOptions, open_runtime
    from .tokenizer import TextStream
    out, log = out or sys.stdout, log or sys.stderr
    msgs = None
    if opts.raw is None:            # read before the (slow) load so a bad file fails fast
        msgs = _read_messages(opts.messages) if opts.messages else [{"role": "user", "content": opts.prompt}]
    images, names = read_images(opts, msgs)
    sampling_params(opts, {}, ())   # the flags given are checked now; the artifact's defaults fill in later
    t0 = time.perf_counter()
    rt = open_runtime(RuntimeOptions(artifact=opts.artifact, tp=opts.tp, device=opts.device, dtype=opts.dtype,
                                     backend=opts.backend, draft_tokens=opts.draft_tokens, max_concurrency=1,
                                     max_context=opts.max_context, verify=opts.verify, eager=opts.eager,
                                     async_scheduling=opts.async_scheduling))
    try:
        tok, eng = rt.tokenizer, rt.engine
        vis = _attach_vision(opts, rt)
        load_s = time.perf_counter() - t0
        ids = prompt_ids(opts, tok, msgs)
        params = sampling_params(opts, rt.loaded.generation_config, tok.stop_ids)
        if msgs is not None:        # a chat prompt that opens <think>: the grammar starts after it
            from .server.handlers import after_reasoning
            params = after_reasoning(tok, ids, params)
        vr = vis.preprocess_request(ids, images, names) if images else None
        eng.add_request("generate", ids, params, vision=vr)
        n_prompt = len(vr) if vr is not None else len(ids)
        stream, reason, n_out = TextStream(tok), None, 0
        while eng.has_work():
            for o in eng.step():
                n_out += len(o.new_token_ids)
                out.write(stream.push(o.new_token_ids))
                out.flush()
                reason = o.finish_reason or reason
        out.write(stream.flush() + "\n")
        out.flush()
        stats = _stats(eng.stats, load_s, n_prompt, n_out, reason, opts.draft_tokens)
    finally:
        rt.close()
    _report(stats, log)
    if opts.stats_json:
        _write_stats(opts.stats_json, stats)
    return stats


def _write_stats(path: str, stats: dict) -> None:
    try:       # temp file + rename in the checked folder; no folder is created behind the user's back
        write_json_atomic(path, stats, make_parents=False)
    except OSError as e:
        raise GenerateError(f"--stats-json {path}: cannot write: {e.strerror or e}") from None


def _attach_vision(opts: GenerateOptions, rt):
    """Rank 0 binds the tower (followers only receive embeddings) and the engine accepts images."""
    if opts.vision is None:
        return None
    from .server.runtime import DTYPES
    from .vision.setup import build_vision_runtime
    vis = build_vision_runtime(rt.loaded, rt.engine.model.ops, opts.vision, dtype=DTYPES[opts.dtype])
    rt.engine.attach_vision(vis)
    return vis


def _stats(es, load_s: float, n_prompt: int, n_out: int, reason, k: int) -> dict:
    spec = es.spec.to_dict() if es.spec is not None else {}
    return {"load_s": load_s, "prefill_tok_s": es.prefill_tok_s, "decode_tok_s": es.decode_tok_s,
            "prompt_tokens": n_prompt, "generated_tokens": n_out, "finish_reason": reason,
            "draft_tokens": k, "drafted": spec.get("drafted", 0), "accepted": spec.get("accepted", 0),
            "acceptance_per_position": spec.get("acceptance_per_position", []),
            "tokens_per_round": spec.get("tokens_per_round", 1.0), "spec_rounds": spec.get("rounds", 0)}


def _report(s: dict, log) -> None:
    print(f"load {s['load_s']:.2f} s | prefill {s['prompt_tokens']} tok at {s['prefill_tok_s']:.1f} tok/s | "
          f"decode {s['generated_tokens']} tok at {s['decode_tok_s']:.1f} tok/s | finish {s['finish_reason']}",
          file=log)
    if s["draft_tokens"]:
        rate = s["accepted"] / s["drafted"] if s["drafted"] else 0.0
        per = ", ".join(f"{a:.2f}" for a in s["acceptance_per_position"])
        print(f"mtp K={s['draft_tokens']}: accepted {s['accepted']}/{s['drafted']} ({rate:.1%}), "
              f"per position [{per}], {s['tokens_per_round']:.2f} tokens/round over {s['spec_rounds']} rounds",
              file=log)


def _default_device() -> str:
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


@main.command("generate")
@click.argument("artifact_dir")
@click.option("--prompt", help="User message, rendered with the artifact's chat template.")
@click.option("--messages", type=click.Path(dir_okay=False), help="JSON file with a list of chat messages.")
@click.option("--raw", help="Text fed to the model as is (no chat template).")
@click.option("--max-new", default=128, show_default=True, type=click.IntRange(1), help="Tokens to generate at most.")
@click.option("--spec", type=click.Choice(["none", "mtp"]), default="none", show_default=True,
              help="Speculative decoding with the artifact's MTP module.")
@click.option("--draft-tokens", default=3, show_default=True, type=int, help="MTP drafts per round (1..7).")
@click.option("--draft-head", default=None, envvar="NINFER_DRAFT_HEAD",
              help="Where MTP drafts get their logits: lm_head, nvfp4 (an NVFP4 copy of the lm_head made "
                   "at load), nvfp4:N (only token ids below N) or auto (nvfp4 where the lm_head allows it); "
                   "verify always uses the lm_head (env NINFER_DRAFT_HEAD). [default: auto]")
@click.option("--tp", default=1, show_default=True, type=click.IntRange(1), help="Tensor-parallel ranks.")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), help="Default: cuda when visible, else cpu.")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]),
              help="Activation dtype. Default: bfloat16 on cuda, float32 on cpu.")
@click.option("--backend", type=click.Choice(["torch", "triton"]), default="torch", show_default=True)
@click.option("--temperature", type=float, help="0 = greedy. Default: generation_config.json.")
@click.option("--top-k", type=int)
@click.option("--top-p", type=float)
@click.option("--min-p", type=float)
@click.option("--presence-penalty", type=float, default=0.0)
@click.option("--frequency-penalty", type=float, default=0.0)
@click.option("--repetition-penalty", type=float,
              help="HF / vLLM repetition penalty over prompt and output tokens (1 = off). Default: "
                   "generation_config.json's, else 1.")
@click.option("--seed", type=int, help="Seed of the request's sampler (reproducible output).")
@click.option("--no-think", is_flag=True, help="Render the chat template with enable_thinking=False.")
@click.option("--max-context", type=int,
              help=f"Context length in tokens (prompt + generated), at least {MIN_KV_TOKENS}.")
@click.option("--no-verify", is_flag=True, help="Skip checksum verification at load.")
@click.option("--stats-json", type=click.Path(dir_okay=False), help="Write load/throughput/MTP stats here.")
@click.option("--eager", is_flag=True, help="Do not capture CUDA graphs (decode/verify/draft steps run eagerly).")
@click.option("--no-async-scheduling", is_flag=True,
              help="Read each decode step's tokens back before launching the next (default on CUDA: launch ahead).")
@click.option("--vision", is_flag=True,
              help="Accept image_url parts in --messages (data URIs or local paths); loads the vision tower.")
@click.option("--json-schema", help="Constrain the answer to this JSON schema (its text, or @FILE; '{}': any JSON). "
                                    "Needs xgrammar (pip install 'ninfer[structured]').")
@click.option("--regex", help="Constrain the answer to this regular expression (xgrammar).")
@click.option("--grammar-file", type=click.Path(dir_okay=False), help="Constrain the answer to this EBNF grammar "
                                                                      "(xgrammar's syntax, root rule `root`).")
@image_limit_options("prompt")
@user_errors
def generate_cmd(artifact_dir, prompt, messages, raw, max_new, spec, draft_tokens, draft_head, tp, device, dtype,
                 backend, temperature, top_k, top_p, min_p, presence_penalty, frequency_penalty, repetition_penalty,
                 seed, no_think,
                 max_context, no_verify, stats_json, eager, no_async_scheduling, vision, json_schema, regex,
                 grammar_file, max_images, max_image_bytes, max_image_pixels, vision_max_pixels):
    """Generate text for one prompt from ARTIFACT_DIR."""
    from .speculative import MAX_DRAFT_TOKENS
    vis = vision_options(vision, max_images=max_images, max_image_bytes=max_image_bytes,
                         max_image_pixels=max_image_pixels, max_pixels=vision_max_pixels)
    from .draft_head import use as use_draft_head
    use_draft_head(draft_head)
    device = device or _default_device()
    if not 1 <= draft_tokens <= MAX_DRAFT_TOKENS:          # checked even when --spec none ignores it
        raise GenerateError(f"--draft-tokens: expected an integer in 1..{MAX_DRAFT_TOKENS}, got {draft_tokens}")
    opts = GenerateOptions(
        artifact=artifact_dir, prompt=prompt, messages=messages, raw=raw, max_new=max_new,
        draft_tokens=draft_tokens if spec == "mtp" else 0, tp=tp, device=device,
        dtype=dtype or ("bfloat16" if device == "cuda" else "float32"), backend=backend, verify=not no_verify,
        temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty, repetition_penalty=repetition_penalty, seed=seed,
        thinking=not no_think, max_context=max_context,
        stats_json=stats_json, vision=vis, eager=eager,
        async_scheduling=False if no_async_scheduling else None,
        structured=structured_flag(json_schema, regex, grammar_file))
    run_generate(opts)


VISION_FLAGS = IMAGE_LIMIT_FLAGS


def vision_options(enabled: bool, **given) -> VisionOptions | None:
    """--vision and its limits (unset ones keep the defaults); a limit without --vision is an error."""
    given = {k: v for k, v in given.items() if v is not None}
    if not enabled:
        if given:
            raise GenerateError(f"{VISION_FLAGS[next(iter(given))]}: only applies with --vision")
        return None
    from .vision.setup import VisionOptions
    return VisionOptions(allow_files=True, **given)
