"""RMSNorm in two flavours, both computed in float32, with an optional fused residual add:

* ``RMSNorm`` (Llama): ``w * normed(x).to(dtype)``, the weight applied after the cast.
* ``GemmaRMSNorm`` (Gemma): ``(normed(x) * (1 + w)).to(dtype)``; the checkpoint stores the
  zero-centred ``w`` and the product happens before the cast.
* ``Gemma4RMSNorm`` (Gemma 4): ``(normed(x) * w).to(dtype)``, the product before the cast;
  ``ScalelessRMSNorm``: ``normed(x).to(dtype)``, no weight at all (Gemma 4's value and
  router norms).

``norm(x)`` returns the normed ``x``; ``norm(x, residual)`` returns
``(normed(x + residual), x + residual)`` with the add rounded to the activation dtype, as
the Hugging Face models do it. On a GPU this is one Triton kernel
(``kernels/rms_norm.py``); elsewhere its plain-torch reference.
"""

from __future__ import annotations

import torch
from torch import nn

from vtllm.worker.layers.linear import default_weight_loader


class RMSNorm(nn.Module):
    gemma = False
    weight_offset = 1.0  # with ``gemma``: the scale is ``weight_offset + w``

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
        self.weight.weight_loader = default_weight_loader

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        from vtllm.worker.kernels import rms_norm as kernels

        norm = kernels.rms_norm if x.is_cuda else kernels.rms_norm_ref
        normed, new_residual = norm(
            x, self.weight, self.eps, residual, gemma=self.gemma, weight_offset=self.weight_offset
        )
        return normed if residual is None else (normed, new_residual)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(normed(x + residual), x + residual)``; before the first layer, where there
        is no residual stream yet, ``(normed(x), x)``."""
        if residual is None:
            return self(x), x
        return self(x, residual)


class GemmaRMSNorm(RMSNorm):
    gemma = True


class Gemma4RMSNorm(RMSNorm):
    gemma = True
    weight_offset = 0.0


class ScalelessRMSNorm(Gemma4RMSNorm):
    """``normed(x)`` with no learned weight: a constant ones buffer stands in for it, so
    the loader expects no tensor."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        nn.Module.__init__(self)
        self.eps = eps
        self.register_buffer("weight", torch.ones(hidden_size), persistent=False)
