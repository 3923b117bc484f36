"""`ninfer-rt serve --tp N` answers OpenAI requests: start it, wait for /health, one chat and one text completion,
check the replies' shape, stop it.

    python3 bench/serve_tp_check.py --artifact DIR --tp 2 [--port 0] [--timeout-s 600] [--max-tokens 16]
                                    [--device cuda|cpu] [--out bench/results/serve_tp_check.json] [--json]
                                    [-- EXTRA SERVE OPTIONS, e.g. --max-concurrency 1 --no-verify]

The server runs as `python3 -m ninfer_rt.cli serve DIR --tp N --host 127.0.0.1 --port P` in its own process
group (its TP ranks are its children, in that group), with NINFER_API_KEY removed from its environment; its
output goes to a log whose tail is printed on failure. --port 0 lets the OS choose (read from the server's
"listening on" line). --timeout-s bounds everything from the start to the last reply; at the end, on an error
or at the deadline the server gets SIGTERM (it stops its ranks), then its whole group SIGKILL after it exits or a
grace period passes.
Checks (OpenAI shape): HTTP 200; chat: choices[0].message.content is a str; completion: choices[0].text is a
str; finish_reason is "stop" or "length"; usage has integer prompt/completion/total tokens that add up,
completion_tokens <= max_tokens, and == max_tokens when finish_reason is "length"; the server exits 0 on SIGTERM.
Prints one summary line (or the JSON record with --json) and writes the record
{"tp", "ok", "http_status", "completion_tokens", "latency_s", "load_s", "gpu", ...} to --out; exit status
0 when every check passed, 1 when one failed, 2 on bad arguments, a server that cannot be started or an
unwritable --out.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from bench_cli import ArgParser
from ninfer_formats.atomic import write_json_atomic

OUT = Path(__file__).resolve().parent / "results" / "serve_tp_check.json"
FINISH = ("stop", "length")
GRACE_S = 20.0            # SIGTERM -> SIGKILL: the server drains (we pass --drain-timeout 5) and stops its ranks
LOG_TAIL = 30
CHAT_PROMPT = [{"role": "user", "content": "Name three colours."}]
TEXT_PROMPT = "The quick brown fox"


class CheckFailed(Exception):
    """The server did not come up or did not answer (the record says why)."""


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---- the server process ----
def server_command(args) -> list[str]:
    cmd = [sys.executable, "-m", "ninfer_rt.cli", "serve", args.artifact, "--tp", str(args.tp),
           "--host", "127.0.0.1", "--port", str(args.port), "--drain-timeout", "5"]
    return cmd + (["--device", args.device] if args.device else []) + list(args.serve_args)


def start(cmd: list[str], log_file) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "NINFER_API_KEY"}
    return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)


def _killpg(proc: subprocess.Popen, sig) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def stop(proc: subprocess.Popen, grace_s: float = GRACE_S) -> int | None:
    """SIGTERM to the server (it drains and stops its own ranks; a signal to the whole group would kill the
    ranks under it); after it exits or `grace_s` passes, SIGKILL to whatever is left in its process group
    (ranks must not outlive the check). Returns the server's exit code."""
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(grace_s)
    _killpg(proc, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(10.0)
    return proc.poll()


def tail(path: str, n: int = LOG_TAIL) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def address(proc, log_path: str, deadline: float) -> str:
    """host:port from the server's "listening on http://..." line."""
    pat = re.compile(r"listening on http://(\S+)")
    while True:
        m = pat.search(Path(log_path).read_text(errors="replace"))
        if m:
            return m.group(1)
        if proc.poll() is not None:
            raise CheckFailed(f"the server exited (code {proc.returncode}) before listening")
        if time.monotonic() > deadline:
            raise CheckFailed("the server did not start listening before the deadline")
        time.sleep(0.1)


def wait_healthy(url: str, proc, deadline: float) -> None:
    while True:
        status, body = get(url + "/health", min(5.0, deadline - time.monotonic()))
        if status == 200:
            return
        if isinstance(body, dict) and body.get("status") == "error":
            raise CheckFailed(f"/health: {body.get('detail')}")
        if proc.poll() is not None:
            raise CheckFailed(f"the server exited (code {proc.returncode}) while loading")
        if time.monotonic() > deadline:
            raise CheckFailed(f"/health did not answer 200 before the deadline (last: {status} {body})")
        time.sleep(0.2)


# ---- HTTP ----
def _request(req, timeout: float) -> tuple[int | None, object]:
    try:
        with urllib.request.urlopen(req, timeout=max(timeout, 0.1)) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    except (urllib.error.URLError, OSError) as e:       # refused while starting, reset, timed out
        return None, f"{type(e).__name__}: {getattr(e, 'reason', e)}"
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")[:300]


def get(url: str, timeout: float):
    return _request(urllib.request.Request(url), timeout)


def post(url: str, body: dict, timeout: float):
    data = json.dumps(body).encode()
    return _request(urllib.request.Request(url, data, {"Content-Type": "application/json"}), timeout)


# ---- checks ----
def check_reply(kind: str, status, body, max_tokens: int) -> list[str]:
    """What is wrong with a chat ("chat") or text ("completion") reply; [] when it has the OpenAI shape."""
    if status != 200 or not isinstance(body, dict):
        return [f"{kind}: HTTP {status}: {str(body)[:300]}"]
    bad = []
    choices = body.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return [f"{kind}: no choices[0] in the reply"]
    c = choices[0]
    text = (c.get("message") or {}).get("content") if kind == "chat" else c.get("text")
    if not isinstance(text, str):
        bad.append(f"{kind}: choices[0].{'message.content' if kind == 'chat' else 'text'} is "
                   f"{type(text).__name__}, not str")
    if c.get("finish_reason") not in FINISH:
        bad.append(f"{kind}: finish_reason {c.get('finish_reason')!r} is not one of {FINISH}")
    u = body.get("usage")
    names = ("prompt_tokens", "completion_tokens", "total_tokens")
    if not isinstance(u, dict) or not all(isinstance(u.get(k), int) and u[k] >= 0 for k in names):
        return bad + [f"{kind}: usage {u!r} lacks non-negative integer {', '.join(names)}"]
    if u["prompt_tokens"] + u["completion_tokens"] != u["total_tokens"]:
        bad.append(f"{kind}: usage does not add up: {u}")
    if u["completion_tokens"] > max_tokens or (c.get("finish_reason") == "length"
                                               and u["completion_tokens"] != max_tokens):
        bad.append(f"{kind}: {u['completion_tokens']} completion tokens with max_tokens {max_tokens} and "
                   f"finish_reason {c.get('finish_reason')!r}")
    return bad


def ask(url: str, kind: str, model: str | None, max_tokens: int, deadline: float) -> dict:
    body = {"max_tokens": max_tokens, "temperature": 0, **({"model": model} if model else {})}
    if kind == "chat":
        path, body["messages"] = "/v1/chat/completions", CHAT_PROMPT
    else:
        path, body["prompt"] = "/v1/completions", TEXT_PROMPT
    t = time.monotonic()
    status, reply = post(url + path, body, deadline - t)
    out = {"http_status": status, "latency_s": round(time.monotonic() - t, 3),
           "problems": check_reply(kind, status, reply, max_tokens)}
    if isinstance(reply, dict):
        c = (reply.get("choices") or [{}])[0]
        text = (c.get("message") or {}).get("content") if kind == "chat" else c.get("text")
        out.update(finish_reason=c.get("finish_reason"), text=text if isinstance(text, str) else None,
                   completion_tokens=(reply.get("usage") or {}).get("completion_tokens"))
    return out


# ---- the run ----
def gpu_name(device: str | None) -> str:
    """Asked after the server stopped, so this process never holds a context on a GPU the server uses. Never
    raises: a server that could not use the GPU is a failed check with a record, not a traceback."""
    import torch

    from bench_device import device_name
    cuda = torch.cuda.is_available()
    if (device or ("cuda" if cuda else "cpu")) == "cpu":
        return device_name("cpu")
    return device_name("cuda") if cuda else "cuda (no CUDA device visible to the check)"


def exercise(url: str, proc, args, deadline: float, rec: dict, t0: float) -> None:
    wait_healthy(url, proc, deadline)
    rec["load_s"] = round(time.monotonic() - t0, 2)
    log(f"serve_tp_check: healthy after {rec['load_s']:.1f} s; asking")
    status, models = get(url + "/v1/models", max(0.1, deadline - time.monotonic()))
    model = None
    if status == 200 and isinstance(models, dict) and models.get("data"):
        model = models["data"][0].get("id")
    else:
        rec["problems"].append(f"/v1/models: HTTP {status}: {str(models)[:200]}")
    rec["model"] = model
    for kind in ("chat", "completion"):
        rec[kind] = ask(url, kind, model, args.max_tokens, deadline)
        rec["problems"] += rec[kind]["problems"]
    chat = rec["chat"]
    rec.update(http_status=chat["http_status"], completion_tokens=chat.get("completion_tokens"),
               latency_s=chat["latency_s"])


def run(args) -> dict:
    rec = {"bench": "serve_tp_check", "tp": args.tp, "ok": False, "http_status": None, "completion_tokens": None,
           "latency_s": None, "load_s": None, "gpu": None, "artifact": args.artifact, "device": args.device,
           "max_tokens": args.max_tokens, "problems": []}
    t0 = time.monotonic()
    deadline = t0 + args.timeout_s
    cmd = server_command(args)
    log("serve_tp_check: " + " ".join(cmd))
    with tempfile.TemporaryDirectory(prefix="serve_tp_check-") as tmp:
        log_path = os.path.join(tmp, "server.log")
        with open(log_path, "wb") as lf:
            proc = start(cmd, lf)
        try:
            url = "http://" + address(proc, log_path, deadline)
            exercise(url, proc, args, deadline, rec, t0)
        except CheckFailed as e:
            rec["problems"].append(str(e))
        finally:
            running = proc.poll() is None
            rec["server_exit_code"] = stop(proc)
            if running and rec["server_exit_code"] != 0:
                rec["problems"].append(f"the server exited with code {rec['server_exit_code']} after SIGTERM "
                                       f"(0 expected: drained and stopped its ranks)")
            if rec["problems"]:
                rec["server_log_tail"] = tail(log_path)
    rec["ok"] = not rec["problems"]
    rec["gpu"] = gpu_name(args.device)
    return rec


def parse_args(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = ArgParser(description=__doc__.splitlines()[0])
    ap.add_argument("--artifact", required=True, help="artifact folder (or hf://ORG/REPO) with a TP set of --tp")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--port", type=int, default=0, help="0: any free port")
    ap.add_argument("--timeout-s", type=float, default=600.0, help="start to last reply")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None, help="passed to serve (default: its own)")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--json", action="store_true", help="print the record as JSON instead of the summary line")
    args = ap.parse_args(argv)
    args.serve_args = extra
    return args


def validate(args) -> str | None:
    if not 1 <= args.tp <= 8:
        return f"--tp {args.tp}: expected 1..8"
    if not 0 <= args.port <= 65535:
        return f"--port {args.port}: expected 0..65535"
    if args.timeout_s <= 0 or args.max_tokens < 1:
        return "--timeout-s must be positive and --max-tokens at least 1"
    if not args.artifact.startswith("hf://") and not os.path.exists(args.artifact):
        return f"{args.artifact}: no such file or folder"
    return None


def summary(r: dict) -> str:
    head = f"serve --tp {r['tp']}: {'OK' if r['ok'] else 'FAILED'}"
    if r["load_s"] is not None:
        head += f"; healthy after {r['load_s']:.1f} s"
    if r["http_status"] is not None:
        head += (f"; chat HTTP {r['http_status']} in {r['latency_s']:.2f} s, {r['completion_tokens']} tokens "
                 f"({r['chat'].get('finish_reason')})")
    if "completion" in r:
        head += f"; completion HTTP {r['completion']['http_status']}"
    head += f"; {r['gpu']}"
    return head + ("" if r["ok"] else "; " + " | ".join(r["problems"]))


def main(argv=None) -> int:
    args = parse_args(argv)
    err = validate(args)
    if err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    try:
        rec = run(args)                 # OSError: the server could not be started at all
        write_json_atomic(args.out, rec)
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not rec["ok"] and rec.get("server_log_tail"):
        log("server log (tail):\n" + rec["server_log_tail"])
    print(json.dumps(rec, indent=1) if args.json else summary(rec))
    return 0 if rec["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
