"""A Hugging Face hub cache laid out as huggingface_hub writes it, filled from a local
model directory, so that tests resolve ``org/name`` offline (HF_HUB_OFFLINE=1)::

    CACHE/models--ORG--NAME/blobs/<name>             (hub: content hashes; here: names)
    CACHE/models--ORG--NAME/snapshots/<commit>/FILE  -> ../../blobs/<name>
    CACHE/models--ORG--NAME/refs/main                <commit>
"""

from __future__ import annotations

import os
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def populate_hf_cache(cache_dir: Path, repo_id: str, model_dir: Path, commit: str = COMMIT) -> Path:
    """Lay ``model_dir``'s files out as revision ``commit`` (= main) of ``repo_id``;
    returns the snapshot directory. Blobs are symlinks to the originals (no copies)."""
    org, name = repo_id.split("/")
    repo = cache_dir / f"models--{org}--{name}"
    blobs, snapshot = repo / "blobs", repo / "snapshots" / commit
    blobs.mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for source in sorted(Path(model_dir).iterdir()):
        if not source.is_file():
            continue
        blob = blobs / source.name
        if not blob.exists():
            blob.symlink_to(source.resolve())
        link = snapshot / source.name
        if not link.exists():
            link.symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot
