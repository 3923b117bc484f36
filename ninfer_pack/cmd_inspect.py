"""`ninfer-pack inspect FILE` and `ninfer-pack verify PATH...` (thin wrappers over ninfer_formats.container)."""
from __future__ import annotations

import json
import sys

import click

from ninfer_formats.constants import FORMATS
from ninfer_formats.container import check_paths, open_artifact

from .cli import main, user_errors


def inspect_report(path) -> dict:
    """Everything `inspect` shows, as plain JSON-able data (structure is validated; checksums are not read)."""
    with open_artifact(path) as a:
        h = a.header
        tensors = [{**t.to_json(), "params": t.numel, "bits_per_weight": round(8 * t.length / t.numel, 4)}
                   for t in a.tensors.values()]
        resources = [r.to_json() for r in a.resources.values()]
        params, tbytes = sum(t["params"] for t in tensors), sum(t["length"] for t in tensors)
        by_fmt: dict[str, dict] = {}
        for t in tensors:
            f = by_fmt.setdefault(t["format"], {"tensors": 0, "params": 0, "bytes": 0})
            f["tensors"] += 1
            f["params"] += t["params"]
            f["bytes"] += t["length"]
        return {
            "path": a.path, "file_size": h.file_size,
            "header": {"version": h.version, "flags": h.flags, "dir_len": h.dir_len,
                       "payload_offset": h.payload_offset, "payload_length": h.payload_length,
                       "dir_xxh3": f"{h.dir_xxh3:032x}"},
            "identity": a.identity, "tp": a.tp, "model": a.model,
            "tensors": tensors, "resources": resources,
            "totals": {"tensors": len(tensors), "params": params, "tensor_bytes": tbytes,
                       "bits_per_weight": round(8 * tbytes / params, 4) if params else 0.0,
                       "resources": len(resources), "resource_bytes": sum(r["length"] for r in resources),
                       "by_format": by_fmt},
        }


def _print_human(r: dict) -> None:
    h, ident, tp, tot = r["header"], r["identity"], r["tp"], r["totals"]
    out = click.echo
    out(f"file       {r['path']}  ({r['file_size']:,} bytes)")
    out(f"header     v{h['version']}, directory {h['dir_len']:,} B, payload at {h['payload_offset']:,}, "
        f"{h['payload_length']:,} B")
    out(f"artifact   {ident['artifact_id']}  ({ident['producer']})")
    out(f"source     {ident['source'] or '-'}")
    out(f"recipe     {json.dumps(ident['recipe'], sort_keys=True)}")
    out(f"tp         rank {tp['rank']} of {tp['size']}")
    for i, f in enumerate(tp["files"]):
        mark = "*" if i == tp["rank"] else " "
        out(f"  {mark} {f['name']}  payload {f['payload_length']:,} B  shard {f['shard_digest']}")
    m = r["model"]
    out(f"model      {m['num_hidden_layers']} layers, hidden {m['hidden_size']}, vocab {m['vocab_size']}, "
        f"mtp {m.get('mtp_num_hidden_layers', 0)}, vision {'yes' if m.get('vision') else 'no'}")
    if r["tensors"]:
        w = max(len(t["name"]) for t in r["tensors"])
        out(f"tensors    {'name':<{w}}  {'shape':<16} {'format':<12} {'bytes':>14} {'bits/w':>8}")
        for t in r["tensors"]:
            out(f"           {t['name']:<{w}}  {str(t['shape']):<16} {t['format']:<12} {t['length']:>14,} "
                f"{t['bits_per_weight']:>8.3f}")
    for res in r["resources"]:
        out(f"resource   {res['name']}  {res['encoding']}  {res['length']:,} B stored, {res['raw_length']:,} B raw")
    for fmt, f in sorted(tot["by_format"].items(), key=lambda kv: FORMATS[kv[0]].code):
        out(f"format     {fmt:<12} {f['tensors']:>5} tensors {f['params']:>16,} params {f['bytes']:>16,} B")
    out(f"total      {tot['tensors']} tensors, {tot['params']:,} params, {tot['tensor_bytes']:,} B, "
        f"{tot['bits_per_weight']:.3f} bits/weight; {tot['resources']} resources, {tot['resource_bytes']:,} B")


@main.command("inspect")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@user_errors
def inspect_cmd(file, as_json):
    """Show a .ninfer file's header, identity, TP set, tensors and resources (no checksum pass)."""
    report = inspect_report(file)
    if as_json:
        click.echo(json.dumps(report, indent=1))
    else:
        _print_human(report)


@main.command("verify")
@click.argument("paths", nargs=-1, required=True, type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Print {ok, problems} as JSON.")
@user_errors
def verify_cmd(paths, as_json):
    """Check structure, every checksum and TP-set consistency of files or folders. Exit 1 on any problem."""
    rep = check_paths(paths)
    if as_json:
        click.echo(json.dumps({"ok": [{"path": i.path, "artifact_id": i.artifact_id, "rank": i.rank,
                                       "tp_size": i.tp_size} for i in rep.ok],
                               "problems": rep.problems}, indent=1))
    elif not rep.problems:
        for i in rep.ok:
            click.echo(f"OK {i.path} ({i.summary()})")
    if rep.problems:
        more = f" (+{len(rep.problems) - 1} more)" if len(rep.problems) > 1 else ""
        click.echo(f"error: {rep.problems[0]}{more}", err=True)
        sys.exit(1)
