"""Tensor-parallel process group and the collectives the layers need.

``TPGroup`` is passed to every parallel layer at construction; with ``size == 1`` every
collective is a no-op, so single-rank runs never touch ``torch.distributed``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    """This rank's place in the tensor-parallel group."""

    rank: int = 0
    size: int = 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over ranks, in place; returns it."""
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Every rank's ``x`` becomes rank ``src``'s, in place; returns it."""
        if self.size > 1:
            dist.broadcast(x, src=src)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``x`` along the last dim, in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)


def init_distributed(
    rank: int, world_size: int, backend: str, init_address: str, device: torch.device
) -> TPGroup:
    """Join the process group (only when ``world_size > 1``) and return this rank's group."""
    if world_size > 1:
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(
            backend=backend,
            init_method=init_address,
            rank=rank,
            world_size=world_size,
            **kwargs,
        )
    return TPGroup(rank=rank, size=world_size)


def destroy_distributed() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def divide(numerator: int, denominator: int, what: str) -> int:
    """``numerator / denominator`` or a ValueError naming what could not be split."""
    if numerator % denominator:
        raise ValueError(
            f"{what} ({numerator}) is not divisible by --tensor-parallel-size ({denominator})"
        )
    return numerator // denominator
