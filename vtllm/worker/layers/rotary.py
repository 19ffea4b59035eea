"""Rotary position embedding (rotate-half / NeoX layout, as HF Llama uses).

Frequencies come from ``rope_theta`` and an optional scaling: ``default``, ``linear``,
``llama3`` or ``proportional`` (Gemma 4's global layers: only the first
``partial_rotary_factor`` of the frequency pairs turn, the rest have frequency 0, i.e. the
identity rotation, over the full ``head_dim``). Both the old (``rope_theta`` + ``rope_scaling``) and the transformers-5
(``rope_parameters``) config.json spellings are read.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def rope_parameters(hf_config: dict[str, Any]) -> dict[str, Any]:
    """``{"rope_type", "rope_theta", ...scaling fields}`` from either config spelling."""
    params = dict(hf_config.get("rope_parameters") or {})
    params.update(hf_config.get("rope_scaling") or {})
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params["type"]
    params.setdefault("rope_type", "default")
    params.setdefault("rope_theta", hf_config.get("rope_theta", 10000.0))
    return params


def inverse_frequencies(head_dim: int, params: dict[str, Any]) -> torch.Tensor:
    """``[head_dim // 2]`` float32 inverse frequencies after scaling."""
    theta = float(params["rope_theta"])
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    rope_type = params["rope_type"]
    if rope_type == "default":
        pass
    elif rope_type == "linear":
        inv_freq = inv_freq / float(params["factor"])
    elif rope_type == "llama3":
        inv_freq = _llama3_scale(inv_freq, params)
    elif rope_type == "proportional":
        num_rotated = int(float(params.get("partial_rotary_factor", 1.0)) * head_dim // 2)
        inv_freq[num_rotated:] = 0.0
        inv_freq = inv_freq / float(params.get("factor", 1.0))
    else:
        raise NotImplementedError(
            f"rope scaling {rope_type!r} is not supported (default, linear, llama3, "
            "proportional are)"
        )
    return inv_freq.float()


def _llama3_scale(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by ``factor``, blend between."""
    factor = float(params["factor"])
    low = float(params["low_freq_factor"])
    high = float(params["high_freq_factor"])
    old_len = float(params["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, blended, scaled)


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, each ``[num_tokens, 1, head_dim // 2]``, computed once per step."""
    freqs = positions.float().unsqueeze(-1) * inv_freq  # [num_tokens, head_dim // 2]
    return freqs.cos().to(dtype).unsqueeze(1), freqs.sin().to(dtype).unsqueeze(1)


def cos_sin_table(rotary_dim: int, max_position: int, params: dict[str, Any]) -> torch.Tensor:
    """``[max_position, rotary_dim]`` float32, cos | sin of every position: the table
    ``kernels/rotary.py`` reads."""
    inv_freq = inverse_frequencies(rotary_dim, params)
    cos, sin = rope_cos_sin(torch.arange(max_position), inv_freq, torch.float32)
    return torch.cat((cos, sin), dim=-1)[:, 0]


class RotaryEmbedding(nn.Module):
    """Rotates q and k in place by their positions, from a cos/sin table built once:
    ``cos_sin_cache`` ``[max_position, head_dim]`` float32, cos | sin per position (the
    layout of ``kernels/rotary.py``). One Triton kernel for q and k on a GPU; its
    plain-torch reference elsewhere. Both compute in fp32 and round once."""

    def __init__(self, head_dim: int, max_position: int, params: dict[str, Any]) -> None:
        super().__init__()
        cache = cos_sin_table(head_dim, max_position, params)  # [max_position, head_dim]
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim], rotated in place
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], rotated in place
    ) -> None:
        from vtllm.worker.kernels import rotary as kernels

        rotate = kernels.rotary_embedding if q.is_cuda else kernels.rotary_embedding_ref
        rotate(positions, q, k, self.cos_sin_cache)
