"""`ninfer-pack upload OUT_DIR REPO_ID`: verify an artifact folder, then push it to the Hugging Face Hub."""
from __future__ import annotations

import sys

import click

from .cli import main, user_errors


@main.command("upload")
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.argument("repo_id")
@click.option("--private", is_flag=True, help="Create the repo as private (if it does not exist).")
@click.option("--revision", default=None, help="Branch to upload to (created if missing).")
@click.option("--dry-run", is_flag=True, help="Verify and print the files and model card; upload nothing.")
@user_errors
def upload_cmd(out_dir, repo_id, private, revision, dry_run):
    """Verify OUT_DIR (checksums, TP set) and upload it to REPO_ID."""
    from .upload import VerifyError, plan_upload, upload
    try:
        plan = plan_upload(out_dir, repo_id)
    except VerifyError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(1)
    click.echo(f"verified artifact {plan.artifact_id} in {plan.folder}", err=True)
    if dry_run:
        for name, size in plan.files:
            click.echo(f"{size:>16}  {name}")
        click.echo(f"{sum(s for _, s in plan.files):>16}  total -> {repo_id}"
                   + (f" (branch {revision})" if revision else ""))
        click.echo("")
        click.echo(plan.card)
        return
    click.echo(upload(plan, private=private, revision=revision))
