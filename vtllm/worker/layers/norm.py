"""RMSNorm in two flavours, both computed in float32:

* ``RMSNorm`` (Llama): ``w * normed(x).to(dtype)``, the weight applied after the cast.
* ``GemmaRMSNorm`` (Gemma): ``(normed(x) * (1 + w)).to(dtype)``; the checkpoint stores the
  zero-centred ``w`` and the product happens before the cast.
"""

from __future__ import annotations

import torch
from torch import nn

from vtllm.worker.layers.linear import default_weight_loader


def _normed(x32: torch.Tensor, eps: float) -> torch.Tensor:
    return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
        self.weight.weight_loader = default_weight_loader

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * _normed(x.float(), self.eps).to(x.dtype)


class GemmaRMSNorm(RMSNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (_normed(x.float(), self.eps) * (1.0 + self.weight.float())).to(x.dtype)
