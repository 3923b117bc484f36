"""`ninfer-pack convert SOURCE OUT_DIR`: a thin click wrapper over `ninfer_pack.convert.convert`."""
from __future__ import annotations

import json
import sys

import click

from .cli import main, user_errors
from .recipes import BUILTIN, DEFAULT


@main.command("convert")
@click.argument("source")
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("--recipe", default=DEFAULT, show_default=True, metavar="|".join(BUILTIN) + "|FILE",
              help="Built-in recipe or a TOML/JSON recipe file (base, [roles], [tensors]).")
@click.option("--override", "overrides", multiple=True, metavar="ROLE=FMT",
              help="Change one role's format, e.g. lm_head=bf16 (repeatable).")
@click.option("--tp", type=click.Choice(["1", "2", "4"]), default="1", show_default=True,
              help="Tensor-parallel ranks to pre-shard for.")
@click.option("-j", "--jobs", type=click.IntRange(min=1), default=None,
              help="Worker processes [default: all cores].")
@click.option("--no-vision", is_flag=True, help="Leave the vision tower out.")
@click.option("--no-mtp", is_flag=True, help="Leave the MTP draft head out.")
@click.option("--force", is_flag=True, help="Replace a complete artifact, another run's partial output, or a README.md/report.json "
                   "ninfer-pack did not write (only this artifact's rank files are deleted).")
@click.option("--base-model", default=None, help="Hub id for the model card [default: the Hub source].")
@click.option("--quiet", is_flag=True, help="No progress bars.")
@click.option("--json", "as_json", is_flag=True, help="Print the report summary as JSON.")
@user_errors
def convert_cmd(source, out_dir, recipe, overrides, tp, jobs, no_vision, no_mtp, force, base_model, quiet,
                as_json):
    """Pack a Hugging Face Qwen3.8 checkpoint (folder or Hub repo id) into OUT_DIR."""
    from .convert import convert
    try:
        res = convert(source, out_dir, recipe=recipe, overrides=overrides, tp=int(tp), jobs=jobs,
                      vision=not no_vision, mtp=not no_mtp, force=force, progress=not quiet,
                      base_model=base_model)
    except KeyboardInterrupt:
        click.echo("error: interrupted; rerun the same command to resume", err=True)
        sys.exit(130)
    t = res.report["totals"]
    if as_json:
        click.echo(json.dumps({"out_dir": str(res.out_dir), "files": [str(f) for f in res.files],
                               "artifact_id": res.report["artifact_id"], "totals": t}))
        return
    for f in res.report["files"]:
        click.echo(f"{res.out_dir / f['name']}\t{f['bytes']}")
    click.echo(f"{t['tensors']} tensors, {t['params']} params, {t['bits_per_weight']} bits/weight, "
               f"artifact {res.report['artifact_id']}")
