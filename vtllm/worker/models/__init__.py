"""Model registry: HF ``architectures`` name → decoder class, built from config.json."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vtllm.worker.distributed import TPGroup
from vtllm.worker.models.gemma3 import Gemma3Args, Gemma3ForCausalLM
from vtllm.worker.models.gemma4 import Gemma4Args, Gemma4ForCausalLM
from vtllm.worker.models.llama import LlamaArgs, LlamaForCausalLM
from vtllm.worker.models.moe_llama import MoeLlamaArgs, MoeLlamaForCausalLM

# architecture → (argument parser, model class)
_MODELS: dict[str, tuple[type[LlamaArgs] | type[Gemma4Args], type[nn.Module]]] = {
    "LlamaForCausalLM": (LlamaArgs, LlamaForCausalLM),
    "MistralForCausalLM": (LlamaArgs, LlamaForCausalLM),
    "Qwen2ForCausalLM": (LlamaArgs, LlamaForCausalLM),
    "Qwen3ForCausalLM": (LlamaArgs, LlamaForCausalLM),
    "Gemma3ForCausalLM": (Gemma3Args, Gemma3ForCausalLM),
    "Qwen3MoeForCausalLM": (MoeLlamaArgs, MoeLlamaForCausalLM),
    "MixtralForCausalLM": (MoeLlamaArgs, MoeLlamaForCausalLM),
    "Gemma4ForCausalLM": (Gemma4Args, Gemma4ForCausalLM),
    # its text decoder (vtllm.worker.loader.hf_config.text_part reads the config)
    "Gemma4ForConditionalGeneration": (Gemma4Args, Gemma4ForCausalLM),
}


def build_model(
    hf_config: dict[str, Any], device: torch.device, dtype: torch.dtype, tp: TPGroup
) -> nn.Module:
    """An empty (uninitialised) model on ``device`` in ``dtype``, ready for the loader.

    Parameters are allocated once, directly on the target device; the loader fills them.
    Rope inverse frequencies stay float32 whatever ``dtype`` is.
    """
    architectures = hf_config.get("architectures") or ["LlamaForCausalLM"]
    if architectures[0] not in _MODELS:
        raise NotImplementedError(
            f"architecture {architectures[0]!r} is not supported; supported: " + ", ".join(_MODELS)
        )
    args_cls, model_cls = _MODELS[architectures[0]]
    args = args_cls.from_hf_config(hf_config)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = model_cls(args, tp)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()
