"""Models by Hugging Face name: ``vtllm serve Qwen/Qwen3-0.6B``.

``resolve_model_name`` turns what the user typed into a local model directory, GGUF file or
packaged-model name that ``gguf_convert.resolve_model_dir`` accepts:

* an existing path, a ``.gguf`` path or a packaged GGUF name: returned unchanged;
* ``org/name`` (a Hugging Face repo id) that is no existing path: the snapshot directory
  from ``huggingface_hub.snapshot_download`` — downloaded with its progress bars when
  online, taken from the local cache when offline (``HF_HUB_OFFLINE=1``) or when the hub
  cannot be reached. ``--revision`` picks a branch, tag or commit, ``--download-dir`` the
  cache directory (default: the HF cache, ``HF_HOME`` / ``HF_HUB_CACHE``), and
  ``HF_TOKEN`` authenticates (read by huggingface_hub itself).

Every failure is a ``ModelNotFound`` whose message is one line naming the model and what
to do; the CLI prints it and exits 2.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from vtllm.startup import StartupError

# What a decoder checkpoint needs; never the .bin/.pt/.gguf/.onnx copies many repos carry.
ALLOW_PATTERNS = [
    "*.json",
    "*.safetensors",
    "*.jinja",
    "tokenizer.model",
    "*.txt",
]

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class ModelNotFound(StartupError):
    """A model name that names no usable local path or hub snapshot (one-line message)."""


def looks_like_repo_id(name: str) -> bool:
    """``org/name`` with hub-legal characters, no leading ``/``, ``.`` or ``~``."""
    return bool(_REPO_ID.match(name)) and ".." not in name and not name.endswith(".gguf")


def hub_offline() -> bool:
    """HF_HUB_OFFLINE as huggingface_hub reads it (read at call time: tests set it)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def resolve_model_name(
    name: str | None,
    revision: str | None = None,
    download_dir: str | None = None,
    what: str = "model",
) -> str | None:
    """A local path (or packaged name) for ``name``; see the module docstring.

    ``what`` names the flag in messages (``model`` or ``tokenizer``)."""
    if name is None:
        return None
    path = Path(name).expanduser()
    if path.exists() or not looks_like_repo_id(name):
        return name
    from vtllm.worker.loader.gguf_packages import find_parted_gguf

    if find_parted_gguf(name) is not None:
        return name
    return str(snapshot(name, revision, download_dir, what))


def snapshot(
    repo_id: str, revision: str | None, download_dir: str | None, what: str = "model"
) -> Path:
    """The local snapshot directory of ``repo_id`` at ``revision`` (see module docstring)."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import (
            GatedRepoError,
            HfHubHTTPError,
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )
    except ImportError:  # pragma: no cover - a dependency of vtllm
        raise ModelNotFound(
            f"{what} {repo_id!r} is no local path, and huggingface_hub (needed to fetch it "
            "from the Hugging Face hub) is not installed: pip install huggingface_hub"
        ) from None
    offline = hub_offline()
    where = download_dir or "the Hugging Face cache"
    at = f" at revision {revision!r}" if revision else ""
    try:
        return Path(
            snapshot_download(
                repo_id,
                revision=revision,
                cache_dir=download_dir,
                local_files_only=offline,
                allow_patterns=ALLOW_PATTERNS,
            )
        )
    except GatedRepoError:
        raise ModelNotFound(
            f"{what} {repo_id!r} is gated on the Hugging Face hub: accept its licence on its "
            "page and set HF_TOKEN to a token of that account"
        ) from None
    except RepositoryNotFoundError:
        raise ModelNotFound(
            f"{what} {repo_id!r} is neither a local path nor a Hugging Face repository "
            "(check the name; a private repository needs HF_TOKEN)"
        ) from None
    except RevisionNotFoundError:
        raise ModelNotFound(
            f"{what} {repo_id!r} has no revision {revision!r} on the Hugging Face hub "
            "(--revision takes a branch, tag or commit)"
        ) from None
    except LocalEntryNotFoundError:
        if offline:
            raise ModelNotFound(
                f"{what} {repo_id!r}{at} is not in {where} and HF_HUB_OFFLINE is set: "
                "download it once online (or unset HF_HUB_OFFLINE), or pass a local directory"
            ) from None
        raise ModelNotFound(
            f"{what} {repo_id!r}{at} could not be downloaded (the Hugging Face hub cannot be "
            f"reached) and is not in {where}: check the network, or pass a local directory"
        ) from None
    except (HfHubHTTPError, OSError, ValueError) as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelNotFound(f"{what} {repo_id!r}{at}: {first_line}") from None
