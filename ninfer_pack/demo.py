"""The README's main job on the embedded tiny model: pack (TP2, nvfp4), verify, inspect, generate with MTP.

    python -m ninfer_pack.demo OUT_DIR [--max-new 64] [--json]

Every step runs the real command-line tool in a subprocess (`ninfer-pack convert|verify|inspect`,
`ninfer-rt generate`) and the command is printed before it runs, so the demo doubles as a transcript of
what to type. Reruns are safe: convert gets `--force`. A failing step ends the demo with exit 1 and names
the step; the tool's own `error: ...` line is printed just above. `NINFER_DEMO_MAX_NEW` sets the default
of --max-new (CI uses a small value).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from ninfer_formats.errors import NinferError

DEFAULT_PROMPT = "def fibonacci(n):\n"
INSPECT_LINES = 12
MAX_NEW_ENV = "NINFER_DEMO_MAX_NEW"


class DemoError(NinferError):
    """A demo step failed or the demo's options are unusable (message names the step or option)."""


@dataclass(frozen=True)
class DemoOptions:
    out_dir: Path
    source: Path | None = None           # None = the tiny checkpoint shipped inside the package
    tp: int = 2
    recipe: str = "nvfp4"
    prompt: str = DEFAULT_PROMPT
    draft_tokens: int = 3
    max_new: int = 64

    def __post_init__(self):
        for name in ("tp", "draft_tokens", "max_new"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise DemoError(f"{name}: expected a positive integer, got {v!r}")
        if not self.prompt:
            raise DemoError("prompt: must not be empty")


def tiny_checkpoint() -> Path:
    """The embedded ninfer-tiny HF folder (package data `ninfer_pack/tiny/`)."""
    folder = Path(__file__).resolve().parent / "tiny"
    if not (folder / "config.json").is_file():
        raise DemoError(f"{folder}: the embedded tiny checkpoint is missing (reinstall the package)")
    return folder


def tool(name: str, module: str) -> list[str]:
    """The console script when it is on PATH (what a user types), else `python -m` of its module."""
    return [name] if shutil.which(name) else [sys.executable, "-m", module]


def show(argv: list[str]) -> str:
    """Shell-pasteable rendering; arguments with newlines use bash's $'...' quoting."""
    def one(a: str) -> str:
        if "\n" in a or "\t" in a:
            return "$'" + a.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n").replace("\t", "\\t") + "'"
        return shlex.quote(a)
    return " ".join(one(a) for a in argv)


class Runner:
    """Runs numbered steps; narration to `log` (stdout, or stderr under --json so stdout stays JSON)."""

    def __init__(self, total: int, log):
        self.total, self.n, self.log = total, 0, log

    def say(self, msg: str = "") -> None:
        print(msg, file=self.log, flush=True)

    def run(self, step: str, argv: list[str], echo: bool = True) -> str:
        """Run one tool; its stderr (progress, errors) passes through, its stdout is returned (and echoed)."""
        self.n += 1
        self.say(f"\n[{self.n}/{self.total}] {step}\n$ {show(argv)}")
        try:
            p = subprocess.run(argv, stdout=subprocess.PIPE, text=True, check=False)
        except OSError as e:
            raise DemoError(f"step {self.n}/{self.total} ({step}): cannot start {argv[0]} ({e.strerror})") from None
        if echo and p.stdout:
            self.say(p.stdout.rstrip("\n"))
        if p.returncode != 0:
            raise DemoError(f"step {self.n}/{self.total} ({step}) failed with exit code {p.returncode}; "
                            "its error is printed above")
        return p.stdout


def run_demo(opts: DemoOptions, log=None) -> dict:
    """All steps; returns the summary (paths, completion, MTP stats). Raises DemoError naming a failed step."""
    log = log or sys.stdout
    src = opts.source or tiny_checkpoint()
    art, stats_path = opts.out_dir / "artifact", opts.out_dir / "generate_stats.json"
    opts.out_dir.mkdir(parents=True, exist_ok=True)
    stats_path.unlink(missing_ok=True)           # a stale file must not pass for this run's stats
    pack, rt = tool("ninfer-pack", "ninfer_pack.cli"), tool("ninfer-rt", "ninfer_rt.cli")
    r = Runner(4, log)
    r.run(f"pack {src.name} for TP{opts.tp} with the {opts.recipe} recipe",
          pack + ["convert", str(src), str(art), "--tp", str(opts.tp), "--recipe", opts.recipe, "--force"])
    r.run("verify every checksum and the TP set", pack + ["verify", str(art)])
    rank0 = art / f"model.tp{opts.tp}-rank0.ninfer"
    text = r.run("inspect rank 0 (first lines)", pack + ["inspect", str(rank0)], echo=False)
    lines = text.splitlines()
    r.say("\n".join(lines[:INSPECT_LINES]))
    if len(lines) > INSPECT_LINES:
        r.say(f"... ({len(lines) - INSPECT_LINES} more lines)")
    completion = r.run(
        f"generate with MTP speculative decoding (K={opts.draft_tokens}, greedy, TP{opts.tp})",
        rt + ["generate", str(art), "--tp", str(opts.tp), "--raw", opts.prompt, "--spec", "mtp",
              "--draft-tokens", str(opts.draft_tokens), "--max-new", str(opts.max_new), "--temperature", "0",
              "--stats-json", str(stats_path)], echo=False)
    try:
        stats = json.loads(stats_path.read_text())
    except (OSError, ValueError) as e:
        raise DemoError(f"step 4/4 (generate): no readable stats in {stats_path} ({e})") from None
    completion = completion.removesuffix("\n")   # the CLI's final newline
    _print_result(r, opts.prompt, completion, stats)
    return {"artifact": str(art), "files": sorted(str(p) for p in art.glob("*.ninfer")), "prompt": opts.prompt,
            "completion": completion, "stats_json": str(stats_path), "stats": stats}


def _print_result(r: Runner, prompt: str, completion: str, s: dict) -> None:
    rule = "-" * 72
    r.say(f"\n{rule}\n{prompt}{completion}\n{rule}")
    rate = s["accepted"] / s["drafted"] if s["drafted"] else 0.0
    per = ", ".join(f"{a:.2f}" for a in s["acceptance_per_position"])
    r.say(f"generated {s['generated_tokens']} tokens ({s['finish_reason']}) in {s['spec_rounds']} MTP rounds")
    r.say(f"drafted {s['drafted']}, accepted {s['accepted']} ({rate:.1%}); "
          f"acceptance per draft position [{per}]; {s['tokens_per_round']:.2f} tokens/round "
          f"(ceiling {s['draft_tokens'] + 1})")


def _max_new_default() -> int:
    v = os.environ.get(MAX_NEW_ENV)
    if v is None:
        return 64
    try:
        return int(v)
    except ValueError:
        raise DemoError(f"{MAX_NEW_ENV}: expected an integer, got {v!r}") from None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ninfer_pack.demo", description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", type=Path, help="folder for the artifact and the generation stats")
    ap.add_argument("--max-new", type=int, default=None, help=f"tokens to generate [default: ${MAX_NEW_ENV} or 64]")
    ap.add_argument("--draft-tokens", type=int, default=3)
    ap.add_argument("--prompt", default=DEFAULT_PROMPT, help="raw code prefix to complete")
    ap.add_argument("--source", type=Path, default=None, help="HF folder to pack [default: embedded tiny]")
    ap.add_argument("--json", action="store_true", help="narration to stderr, the summary as JSON to stdout")
    a = ap.parse_args(argv)
    log = sys.stderr if a.json else sys.stdout
    try:
        opts = DemoOptions(a.out_dir, source=a.source, prompt=a.prompt, draft_tokens=a.draft_tokens,
                           max_new=a.max_new if a.max_new is not None else _max_new_default())
        summary = run_demo(opts, log)
    except NinferError as e:
        print(f"error: demo: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"error: demo: {e.filename or ''}: {e.strerror or e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("error: demo: interrupted", file=sys.stderr)
        return 130
    if a.json:
        print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
