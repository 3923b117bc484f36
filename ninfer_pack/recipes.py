"""Quantization recipes: which numeric format each tensor *role* gets, plus fusion groups.

Roles cover the matrices; every other tensor (norms, conv1d, A_log, dt_bias, vision biases/norms/patch
embedding/pos_embed) keeps its source dtype bit for bit -- an F32 A_log stays f32.

Built-in recipes (why the exceptions):
- embedding stays bf16 everywhere: it is a gather of one row per token, not a bandwidth-bound matmul,
  so quantizing it saves memory but no time (`--override embedding=q6_k` trades that memory back);
- lm_head is q6_k in the 4-bit and 3-bit recipes: it is the widest matrix and the most sensitive one
  (NInfer's groupwise artifacts keep it at 6 bits, GGUF *_M mixes keep Q6_K there);
- gdn_gates (in_proj_a/b) stay bf16: [nv, H] is tiny and feeds exp/softplus gates (NInfer keeps them bf16);
- mtp is q6_k in the quantized recipes: draft acceptance tracks its accuracy, and it is small;
- vision stays bf16: its K dims (1152, 4304) are not whole 256-blocks, and the tower runs once per image.
A recipe file (TOML or JSON) names a `base` recipe, `[roles]` to change, and optional `[tensors]`
regex -> format rules applied last (e.g. keep the first layers at higher precision).
"""
from __future__ import annotations

import json
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

from ninfer_formats.constants import FORMATS
from ninfer_formats.errors import SourceError

SOURCE = "source"                # keep the checkpoint's dtype
ROLES = ("embedding", "lm_head", "attn_in", "attn_out", "gdn_in", "gdn_out", "gdn_gates", "mlp_in",
         "mlp_out", "mtp", "vision")
_LINEAR = ("attn_in", "attn_out", "gdn_in", "gdn_out", "mlp_in", "mlp_out")


def _builtin(linear: str, head: str, mtp: str) -> dict[str, str]:
    return {**{r: linear for r in _LINEAR}, "embedding": "bf16", "lm_head": head, "gdn_gates": "bf16",
            "mtp": mtp, "vision": "bf16"}


BUILTIN: dict[str, dict[str, str]] = {
    "nvfp4": _builtin("nvfp4", "q6_k", "q6_k"),
    "q6_k": _builtin("q6_k", "q6_k", "q6_k"),
    "iq3_s": _builtin("iq3_s", "q6_k", "q6_k"),
    "bf16": _builtin("bf16", "bf16", "bf16"),
}
DEFAULT = "nvfp4"

_L = r"(?:layers\.\d+)\."
ROLE_RULES: tuple[tuple[str, str], ...] = (
    (r"embed_tokens\.weight", "embedding"),
    (r"lm_head\.weight", "lm_head"),
    (r"mtp\.fc\.weight", "mtp"),
    (r"mtp\.layers\.\d+\.(?:self_attn|mlp)\.\w+_proj\.weight", "mtp"),
    (_L + r"self_attn\.[qkv]_proj\.weight", "attn_in"),
    (_L + r"self_attn\.o_proj\.weight", "attn_out"),
    (_L + r"linear_attn\.in_proj_(?:qkv|z)\.weight", "gdn_in"),
    (_L + r"linear_attn\.in_proj_[ab]\.weight", "gdn_gates"),
    (_L + r"linear_attn\.out_proj\.weight", "gdn_out"),
    (_L + r"mlp\.(?:gate|up)_proj\.weight", "mlp_in"),
    (_L + r"mlp\.down_proj\.weight", "mlp_out"),
    (r"visual\.(?:blocks\.\d+\.(?:attn\.(?:qkv|proj)|mlp\.linear_fc[12])|merger\.linear_fc[12])\.weight", "vision"),
)
# members of one fusion group share an NVFP4 global scale (quant-formats.md §3.2): group key = prefix + tag
FUSION_RULES: tuple[tuple[str, str], ...] = (
    (r"((?:mtp\.)?layers\.\d+\.self_attn)\.[qkv]_proj\.weight", "qkv"),
    (r"((?:mtp\.)?layers\.\d+\.mlp)\.(?:gate|up)_proj\.weight", "gate_up"),
    (r"(layers\.\d+\.linear_attn)\.in_proj_(?:qkv|z)\.weight", "qkvz"),
)
_ROLE_RX = tuple((re.compile(p), r) for p, r in ROLE_RULES)
_FUSION_RX = tuple((re.compile(p), tag) for p, tag in FUSION_RULES)


def role_of(name: str) -> str | None:
    """The recipe role of an artifact tensor, or None (kept in its source dtype)."""
    return next((r for rx, r in _ROLE_RX if rx.fullmatch(name)), None)


def fusion_key(name: str) -> str | None:
    for rx, tag in _FUSION_RX:
        m = rx.fullmatch(name)
        if m:
            return f"{m.group(1)}.{tag}"
    return None


def _check_fmt(fmt: str, where: str) -> str:
    if fmt != SOURCE and fmt not in FORMATS:
        raise SourceError(f"{where}: unknown format {fmt!r} (known: {SOURCE}, {', '.join(FORMATS)})")
    if fmt == "i32":
        raise SourceError(f"{where}: i32 is not a weight format")
    return fmt


@dataclass(frozen=True)
class Recipe:
    name: str
    roles: tuple[tuple[str, str], ...]              # (role, format) for every role
    tensor_rules: tuple[tuple[str, str], ...] = ()  # (regex, format), last match wins

    def __post_init__(self):
        got = dict(self.roles)
        for role, fmt in self.roles:
            if role not in ROLES:
                raise SourceError(f"recipe {self.name}: unknown role {role!r} (roles: {', '.join(ROLES)})")
            _check_fmt(fmt, f"recipe {self.name}: role {role}")
        missing = [r for r in ROLES if r not in got]
        if missing:
            raise SourceError(f"recipe {self.name}: role {missing[0]} has no format")
        for rx, fmt in self.tensor_rules:
            try:
                re.compile(rx)
            except re.error as e:
                raise SourceError(f"recipe {self.name}: tensors rule {rx!r} is not a regex ({e})") from None
            _check_fmt(fmt, f"recipe {self.name}: tensors rule {rx!r}")

    def format_for(self, name: str, source_fmt: str) -> str:
        """The stored format of tensor `name` whose checkpoint dtype is `source_fmt`."""
        role = role_of(name)
        fmt = dict(self.roles)[role] if role else SOURCE
        for rx, f in self.tensor_rules:
            if re.fullmatch(rx, name):
                fmt = f
        return source_fmt if fmt == SOURCE else fmt

    def describe(self) -> dict:
        """JSON form stored in the artifact identity and the model card."""
        d = {"default": self.name, "roles": dict(self.roles)}
        if self.tensor_rules:
            d["tensors"] = [list(r) for r in self.tensor_rules]
        return d


def _parse_file(path: Path) -> dict:
    try:
        raw = path.read_bytes()
        d = json.loads(raw) if path.suffix == ".json" else tomllib.loads(raw.decode("utf-8"))
    except (ValueError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise SourceError(f"{path}: not a valid recipe file ({e})") from None
    if not isinstance(d, dict) or set(d) - {"base", "roles", "tensors"}:
        raise SourceError(f"{path}: a recipe file holds only 'base', 'roles' and 'tensors'")
    if not isinstance(d.get("base", DEFAULT), str):
        raise SourceError(f"{path}: 'base' must be a recipe name, got {type(d['base']).__name__}")
    for key in ("roles", "tensors"):
        table = d.get(key, {})
        if not isinstance(table, dict):
            raise SourceError(f"{path}: '{key}' must be a table of name = format")
        for k, v in table.items():
            if not isinstance(v, str):
                raise SourceError(f"{path}: {key}.{k} must be a format name, got {type(v).__name__} {v!r:.40}")
    return d


def parse_override(text: str) -> tuple[str, str]:
    role, sep, fmt = text.partition("=")
    if not sep or not role or not fmt:
        raise SourceError(f"--override {text!r}: expected ROLE=FORMAT, e.g. lm_head=bf16")
    if role.strip() not in ROLES:
        raise SourceError(f"--override {text!r}: unknown role {role!r} (roles: {', '.join(ROLES)})")
    return role.strip(), fmt.strip()


def load_recipe(spec: str = DEFAULT, overrides: tuple[str, ...] = ()) -> Recipe:
    """A built-in name or a recipe file, then `--override ROLE=FMT` entries."""
    rules: tuple[tuple[str, str], ...] = ()
    if spec in BUILTIN:
        name, roles = spec, dict(BUILTIN[spec])
    elif Path(spec).is_file():
        d = _parse_file(Path(spec))
        base = d.get("base", DEFAULT)
        if base not in BUILTIN:
            raise SourceError(f"{spec}: base recipe {base!r} is not one of {', '.join(BUILTIN)}")
        name, roles = Path(spec).stem, {**BUILTIN[base], **d.get("roles", {})}
        rules = tuple(d.get("tensors", {}).items())
    else:
        raise SourceError(f"--recipe {spec!r}: not a built-in recipe ({', '.join(BUILTIN)}) nor a file")
    for o in overrides:
        role, fmt = parse_override(o)
        roles[role] = fmt
    return Recipe(name, tuple((r, roles[r]) for r in ROLES if r in roles) +
                  tuple((r, f) for r, f in roles.items() if r not in ROLES), rules)
