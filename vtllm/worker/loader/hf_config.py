"""Reading a HF-style model directory's ``config.json`` and ``generation_config.json``."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from vtllm.protocol.messages import ModelFacts
from vtllm.worker.kv_cache_dtype import kv_bytes_per_token

# multimodal wrappers served as their text decoder alone (the model skips the towers)
TEXT_ONLY_WRAPPERS = ("Gemma4ForConditionalGeneration",)


def load_hf_config(model_dir: str | Path) -> dict[str, Any]:
    """``config.json``; for a ``TEXT_ONLY_WRAPPERS`` architecture, its text part."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; --model must be a HF-style model directory")
    return text_part(json.loads(path.read_text()))


def text_part(hf_config: dict[str, Any]) -> dict[str, Any]:
    """A ``TEXT_ONLY_WRAPPERS`` config with its ``text_config`` folded in (the wrapper's
    own keys, e.g. ``architectures``, ``eos_token_id``, ``quantization_config``, win);
    any other config unchanged."""
    architectures = hf_config.get("architectures") or [""]
    text = hf_config.get("text_config")
    if architectures[0] not in TEXT_ONLY_WRAPPERS or not isinstance(text, dict):
        return hf_config
    towers = ("text_config", "vision_config", "audio_config", "model_type")
    return {**text, **{k: v for k, v in hf_config.items() if k not in towers}}


def eos_token_ids(model_dir: str | Path, hf_config: dict[str, Any]) -> list[int]:
    """Every token id that ends generation for this model: generation_config.json's
    ``eos_token_id`` (else config.json's; an int or a list), plus tokenizer_config.json's
    ``eos_token`` (a chat model's end-of-turn token is often only there). The engine core
    decides EOS from this list alone; frontends add nothing to it."""
    ids: list[int] = []
    sources = [hf_config]
    generation_path = Path(model_dir) / "generation_config.json"
    if generation_path.is_file():
        sources.insert(0, json.loads(generation_path.read_text()))
    for source in sources:
        value = source.get("eos_token_id")
        if value is not None:
            ids = [int(v) for v in (value if isinstance(value, list) else [value])]
            break
    tokenizer_eos = _tokenizer_eos_id(Path(model_dir))
    if tokenizer_eos is not None and tokenizer_eos not in ids:
        ids.append(tokenizer_eos)
    return ids


def _tokenizer_eos_id(model_dir: Path) -> int | None:
    """The id of tokenizer_config.json's ``eos_token`` in tokenizer.json, if both exist."""
    config_path, tokenizer_path = model_dir / "tokenizer_config.json", model_dir / "tokenizer.json"
    if not (config_path.is_file() and tokenizer_path.is_file()):
        return None
    eos = json.loads(config_path.read_text()).get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    if not isinstance(eos, str):
        return None
    tokenizer = json.loads(tokenizer_path.read_text())
    for added in tokenizer.get("added_tokens", []):
        if added.get("content") == eos:
            return int(added["id"])
    vocab = tokenizer.get("model", {}).get("vocab")
    if isinstance(vocab, dict) and eos in vocab:
        return int(vocab[eos])
    return None


def model_facts(
    model_dir: str | Path,
    hf_config: dict[str, Any],
    model_name: str,
    kv_cache_specs: Sequence[tuple[int, int]],
    kv_cache_dtype: torch.dtype,
) -> ModelFacts:
    """What rank ``r`` reports: ``kv_bytes_per_token = 2 × Σ kv_heads_per_rank × head_dim
    × KV-cache element bytes`` over the KV caches (``ModelRunner.kv_cache_specs()``: K and
    V of one token on this rank; 1 byte for an FP8 cache, see ``kv_cache_dtype.py``)."""
    num_layers = hf_config["num_hidden_layers"]
    return ModelFacts(
        model_name=model_name,
        vocab_size=hf_config["vocab_size"],
        max_position_embeddings=hf_config.get("max_position_embeddings", 4096),
        eos_token_ids=eos_token_ids(model_dir, hf_config),
        num_layers=num_layers,
        kv_bytes_per_token=sum(
            kv_bytes_per_token(1, num_kv_heads, head_dim, kv_cache_dtype)
            for num_kv_heads, head_dim in kv_cache_specs
        ),
    )
