"""Tensor-parallel linear layers. Weights are created empty and filled by the loader.

* ``ColumnParallelLinear`` splits the output dim: each rank holds a slice of every
  shard (q/k/v, gate/up), so a packed checkpoint tensor lands at its shard's offset.
* ``RowParallelLinear`` splits the input dim and all-reduces the partial sums.

Every parameter carries ``weight_loader(param, loaded, shard_id=None)`` that takes the
full checkpoint tensor and copies this rank's part (converting dtype).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vtllm.worker.distributed import TPGroup, divide


class LinearMethod:
    """How a linear layer multiplies, when its weight is not a plain dense tensor.

    Quantised formats (FP8 on GPUs, int8 on CPUs) set ``layer.linear_method`` after the
    weights are loaded (``process_weights``) and keep their own tensors on the layer. The
    bias and the tensor-parallel reduction stay with the layer.
    """

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``x [num_tokens, in] -> [num_tokens, out]`` without bias."""
        raise NotImplementedError


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    """Copy a replicated tensor whole, converting dtype; shapes must match."""
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs {tuple(loaded.shape)}")
    param.data.copy_(loaded)


def _empty_param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class ColumnParallelLinear(nn.Module):
    """``y = x W^T + b`` with W's rows split over ranks, one or more packed shards.

    ``output_sizes`` are the full (unsplit) sizes of the packed shards, e.g.
    ``[q, k, v]``; ``shard_ids`` name them for the loader. Local weight layout::

        rows: [ q / tp | k / tp | v / tp ]   (this rank's slice of each shard)
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool,
        tp: TPGroup,
        shard_ids: list[str | int] | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.local_sizes = [divide(s, tp.size, "output size") for s in output_sizes]
        self.shard_ids = shard_ids or list(range(len(output_sizes)))
        self.weight = _empty_param(sum(self.local_sizes), input_size)
        self.linear_method: LinearMethod | None = None
        self.weight.weight_loader = self.weight_loader
        self.bias = _empty_param(sum(self.local_sizes)) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = self.weight_loader

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None
    ) -> None:
        index = 0 if shard_id is None else self.shard_ids.index(shard_id)
        if shard_id is None and len(self.local_sizes) > 1:
            raise ValueError("a packed parameter needs a shard id")
        offset = sum(self.local_sizes[:index])
        size = self.local_sizes[index]
        expected = size * self.tp.size
        if loaded.shape[0] != expected or loaded.shape[1:] != param.shape[1:]:
            raise ValueError(
                f"shard {shard_id!r}: checkpoint shape {tuple(loaded.shape)}, expected "
                f"({expected}, {', '.join(map(str, param.shape[1:]))})"
            )
        part = loaded.narrow(0, self.tp.rank * size, size)
        param.data.narrow(0, offset, size).copy_(part)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.linear_method is None:
            return F.linear(x, self.weight, self.bias)  # [num_tokens, local_out]
        y = self.linear_method.apply(self, x)
        return y if self.bias is None else y + self.bias


class RowParallelLinear(nn.Module):
    """``y = x W^T + b`` with W's columns split over ranks; the result is all-reduced.

    The input is already split (the output of a ColumnParallelLinear); the bias is added
    once, after the reduction.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.local_input_size = divide(input_size, tp.size, "input size")
        self.weight = _empty_param(output_size, self.local_input_size)
        self.linear_method: LinearMethod | None = None
        self.weight.weight_loader = self.weight_loader
        self.bias = _empty_param(output_size) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = default_weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        size = self.local_input_size
        if loaded.shape != (param.shape[0], size * self.tp.size):
            raise ValueError(
                f"checkpoint shape {tuple(loaded.shape)}, expected "
                f"({param.shape[0]}, {size * self.tp.size})"
            )
        param.data.copy_(loaded.narrow(1, self.tp.rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = (
            F.linear(x, self.weight)
            if self.linear_method is None
            else self.linear_method.apply(self, x)
        )  # [num_tokens, output_size]
        y = self.tp.all_reduce(partial)
        return y if self.bias is None else y + self.bias
