"""Stream weights from a HF-style directory of ``*.safetensors`` into a built model.

Shard by shard, tensor by tensor: each file is memory-mapped (``safetensors_file``), each
tensor handed out as a zero-copy view of the mapping, renamed through the model's
``packed_modules_mapping`` and given to its parameter's ``weight_loader``, which copies this
rank's part straight into the parameter (on its device: parameters are allocated there,
never on the host first) and converts the dtype. A loader that narrows rows touches only
this rank's pages. Once a tensor's loader returns, its pages leave this process's resident
set, so the host cost of loading is one checkpoint tensor whatever the model's size; no
list or dict of tensors is ever built. ``LoadStats`` counts what was read.
Per-layer KV-cache scales (``self_attn.k_scale`` and the other layouts
``kv_cache_dtype.kv_scale_buffers`` knows) fill the attention layers' scale buffers; they
are optional.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from vtllm.worker.kv_cache_dtype import checked_kv_scale, kv_scale_buffers
from vtllm.worker.layers.linear import default_weight_loader
from vtllm.worker.loader.safetensors_file import MappedSafetensors, SafetensorsFormatError


class WeightLoadError(RuntimeError):
    """The checkpoint does not match the model (missing, unexpected or misshapen tensors)."""


@dataclass
class LoadStats:
    """What ``load_safetensors`` read: tensors, their checkpoint bytes, the largest one
    (the bound on the loader's own host memory), and the files."""

    num_files: int = 0
    num_tensors: int = 0
    checkpoint_bytes: int = 0
    largest_tensor_bytes: int = 0


def iter_safetensors(
    model_dir: str | Path, stats: LoadStats | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, CPU tensor) for every tensor of every ``*.safetensors`` file, files in name
    order, tensors in file order. Each tensor is a view of the mapped file, read as it is
    touched; when the consumer asks for the next one, the previous one's pages are released
    (a view kept past that stays valid: it refaults from the file). ``stats`` is updated
    as tensors go by."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise WeightLoadError(f"no *.safetensors files in {model_dir}")
    for path in files:
        try:
            mapped = MappedSafetensors(path)
        except SafetensorsFormatError as e:
            raise WeightLoadError(str(e)) from e
        with mapped:
            if stats is not None:
                stats.num_files += 1
            for name in mapped.names():
                tensor = mapped.tensor(name)
                if stats is not None:
                    num_bytes = mapped.entries[name].num_bytes
                    stats.num_tensors += 1
                    stats.checkpoint_bytes += num_bytes
                    stats.largest_tensor_bytes = max(stats.largest_tensor_bytes, num_bytes)
                yield name, tensor
                mapped.release(name)  # the consumer is done: its pages leave our RSS


def load_safetensors(model: nn.Module, model_dir: str | Path) -> LoadStats:
    """Fill every parameter of ``model`` from ``model_dir``; returns what was read.

    Raises ``WeightLoadError`` listing missing and unexpected tensors (and shape errors).
    Parameters shared by tying (the LM head of tied-embedding models) count as loaded
    when their owner is.
    """
    params = dict(model.named_parameters())  # tied parameters appear once, first name
    packed = getattr(model, "packed_modules_mapping", {})
    # (name) -> the name the model's own modules use (a multimodal wrapper's text decoder)
    rename = getattr(model, "checkpoint_text_name", lambda name: name)
    ignored = getattr(model, "ignored_checkpoint_suffixes", ())
    # (name) -> True for tensors the model has no use for (a multimodal wrapper's towers)
    skips = getattr(model, "skips_checkpoint_tensor", lambda name: False)
    # (name) -> (parameter name, shard id) | None: names the packed mapping cannot express
    # (one tensor per MoE expert); None falls back to the packed mapping
    map_name = getattr(model, "map_checkpoint_name", lambda name: None)
    loaded: set[tuple[str, str | int | None]] = set()
    unexpected: list[str] = []
    problems: list[str] = []
    stats = LoadStats()
    buffers = dict(model.named_buffers())
    for checkpoint_name, tensor in iter_safetensors(model_dir, stats):
        name = rename(checkpoint_name)
        if name.endswith(ignored) or skips(name):
            continue
        scale_buffers = kv_scale_buffers(name)
        if scale_buffers and all(b in buffers for b in scale_buffers):
            try:
                for buffer_name in scale_buffers:
                    buffers[buffer_name].copy_(checked_kv_scale(tensor))
            except ValueError as e:
                problems.append(f"{checkpoint_name}: {e}")
            continue
        param_name, shard_id = map_name(name) or _map_name(name, packed)
        param = params.get(param_name)
        if param is None and f"model.{param_name}" in params:
            # a bare decoder's checkpoint (Qwen3-Embedding: Qwen3Model, no "model." prefix)
            param_name = f"model.{param_name}"
            param = params[param_name]
        if param is None:
            if _is_tied_alias(model, param_name):
                continue
            unexpected.append(checkpoint_name)
            continue
        loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            with torch.no_grad():
                if shard_id is None:
                    filled = loader(param, tensor)
                else:
                    filled = loader(param, tensor, shard_id)
        except ValueError as e:
            problems.append(f"{checkpoint_name}: {e}")
            continue
        # a loader that fills several shards from one tensor (Gemma 4's stacked experts)
        # returns their ids; others return None
        loaded.update((param_name, s) for s in (filled if filled is not None else [shard_id]))
    # from the parameters as loading left them: a loader may swap its parameter for another
    # (Gemma 4's experts drop FP8 scales when the checkpoint stores them unquantised)
    expected = _expected_shards(model, dict(model.named_parameters()))
    missing = sorted(f"{p}[{s}]" if s is not None else p for p, s in expected - loaded)
    if missing or unexpected or problems:
        parts = [f"checkpoint in {model_dir} does not match the model"]
        if missing:
            parts.append(f"missing {len(missing)}: {', '.join(missing[:20])}")
        if unexpected:
            parts.append(f"unexpected {len(unexpected)}: {', '.join(sorted(unexpected)[:20])}")
        if problems:
            parts.append("; ".join(problems[:20]))
        raise WeightLoadError("; ".join(parts))
    return stats


def _map_name(name: str, packed: dict[str, tuple[str, str | int]]) -> tuple[str, str | int | None]:
    for checkpoint_part, (param_part, shard_id) in packed.items():
        marker = f".{checkpoint_part}."
        if marker in name:
            return name.replace(marker, f".{param_part}."), shard_id
    return name, None


def _expected_shards(
    model: nn.Module, params: dict[str, nn.Parameter]
) -> set[tuple[str, str | int | None]]:
    """Every (parameter, shard id) the checkpoint must provide."""
    expected: set[tuple[str, str | int | None]] = set()
    modules = dict(model.named_modules())
    for name in params:
        module_name = name.rsplit(".", 1)[0]
        shard_ids = getattr(modules.get(module_name), "shard_ids", None)
        if getattr(params[name], "shard_ids", None) is not None:  # one tensor per MoE expert
            expected.update((name, s) for s in params[name].shard_ids)
        elif shard_ids is not None and len(shard_ids) > 1:
            expected.update((name, s) for s in shard_ids)
        else:
            expected.add((name, None))
    return expected


def _is_tied_alias(model: nn.Module, param_name: str) -> bool:
    """True for a checkpoint copy of a parameter the model ties to another (lm_head)."""
    try:
        model.get_parameter(param_name)
    except AttributeError:
        return False
    return True
