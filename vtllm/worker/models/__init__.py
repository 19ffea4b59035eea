"""Model registry: HF ``architectures`` name → decoder class, built from config.json."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vtllm.worker.distributed import TPGroup
from vtllm.worker.models.llama import LlamaArgs, LlamaForCausalLM

_LLAMA_FAMILY = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)


def build_model(
    hf_config: dict[str, Any], device: torch.device, dtype: torch.dtype, tp: TPGroup
) -> nn.Module:
    """An empty (uninitialised) model on ``device`` in ``dtype``, ready for the loader.

    Parameters are allocated once, directly on the target device; the loader fills them.
    """
    architectures = hf_config.get("architectures") or ["LlamaForCausalLM"]
    if architectures[0] not in _LLAMA_FAMILY:
        raise NotImplementedError(
            f"architecture {architectures[0]!r} is not supported; supported: "
            + ", ".join(_LLAMA_FAMILY)
        )
    args = LlamaArgs.from_hf_config(hf_config)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(args, tp)
    finally:
        torch.set_default_dtype(previous)
    model.inv_freq = model.inv_freq.float()
    return model.eval()
