"""Publishing an artifact folder to the Hugging Face Hub, after verifying every checksum and the TP set."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from ninfer_formats.container import open_artifact, verify_paths
from ninfer_formats.errors import NinferError, SourceError

from .out_dir import STATE, complete_files

HUB_MAX_FILE_BYTES = 50 * 10**9          # the Hub refuses single files above 50 GB
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class VerifyError(NinferError):
    """The artifact folder fails verification (CLIs exit 1)."""


class UploadError(NinferError):
    """The Hub refused or failed a request."""


@dataclass(frozen=True)
class UploadPlan:
    folder: Path
    repo_id: str
    files: tuple[tuple[str, int], ...]     # (name, bytes), upload order
    card: str
    artifact_id: str


def plan_upload(out_dir, repo_id: str) -> UploadPlan:
    """Check the folder (complete, verified, Hub-sized) and list what would be uploaded."""
    d = Path(out_dir)
    if not _REPO_ID.match(repo_id):
        raise SourceError(f"{repo_id}: not a Hub repo id of the form owner/name")
    if not d.is_dir():
        raise SourceError(f"{d}: not a folder")
    if (d / STATE).exists():
        raise SourceError(f"{d}: holds an unfinished conversion; rerun `ninfer-pack convert` to finish it")
    ranks = complete_files(d)
    if not ranks:
        raise SourceError(f"{d}: no .ninfer rank files")
    problems = verify_paths([d])
    if problems:
        more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
        raise VerifyError(f"{problems[0]}{more}")
    if not (d / "README.md").is_file():
        raise SourceError(f"{d / 'README.md'}: missing (the model card `ninfer-pack convert` writes)")
    names = [p.name for p in ranks] + [n for n in ("README.md", "report.json") if (d / n).is_file()]
    files = tuple((n, (d / n).stat().st_size) for n in names)
    for n, size in files:
        if size > HUB_MAX_FILE_BYTES:
            raise SourceError(f"{d / n}: {size} bytes is over the Hub's 50 GB per-file limit; "
                              "re-pack with a larger --tp")
    with open_artifact(ranks[0]) as a:
        aid = a.artifact_id
    if (d / "report.json").is_file():
        _check_report(d / "report.json", aid)
    return UploadPlan(d, repo_id, files, (d / "README.md").read_text(encoding="utf-8"), aid)


def _check_report(path: Path, artifact_id: str) -> None:
    """The report is published next to the weights; a torn or stale one (another run's) would mislead."""
    try:
        rep = json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError) as e:
        raise SourceError(f"{path}: not valid JSON ({e}); rerun `ninfer-pack convert --force`") from None
    got = rep.get("artifact_id") if isinstance(rep, dict) else None
    if got != artifact_id:
        raise SourceError(f"{path}: artifact_id {str(got)[:40]!r} does not match the rank files' {artifact_id}")


def upload(plan: UploadPlan, *, private: bool = False, revision: str | None = None, api=None) -> str:
    """create_repo (exist_ok) [+ branch] + upload_folder of exactly the planned files; returns the commit URL."""
    if api is None:
        from huggingface_hub import HfApi
        api = HfApi()
    try:
        api.create_repo(plan.repo_id, repo_type="model", private=private, exist_ok=True)
        if revision:
            api.create_branch(plan.repo_id, branch=revision, repo_type="model", exist_ok=True)
        info = api.upload_folder(repo_id=plan.repo_id, repo_type="model", folder_path=str(plan.folder),
                                 allow_patterns=[n for n, _ in plan.files], revision=revision,
                                 commit_message=f"ninfer artifact {plan.artifact_id}")
    except NinferError:
        raise
    except Exception as e:  # HfHubHTTPError, network errors, auth: one line, no traceback
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UploadError(f"{plan.repo_id}: upload failed: {first}") from None
    return str(getattr(info, "commit_url", info))
