"""Vocab-parallel embedding and LM head: each rank holds a contiguous slice of rows.

The vocabulary is padded up to a multiple of the TP size; padded rows are zero and their
logits are dropped after the all-gather.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vtllm.worker.distributed import TPGroup
from vtllm.worker.layers.linear import LinearMethod


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.rows_per_rank = -(-vocab_size // tp.size)
        self.row_start = tp.rank * self.rows_per_rank
        self.weight = nn.Parameter(
            torch.empty(self.rows_per_rank, hidden_size), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if loaded.shape != (self.vocab_size, param.shape[1]):
            raise ValueError(
                f"checkpoint shape {tuple(loaded.shape)}, expected "
                f"({self.vocab_size}, {param.shape[1]})"
            )
        num_rows = max(0, min(self.rows_per_rank, self.vocab_size - self.row_start))
        param.data.zero_()
        param.data[:num_rows].copy_(loaded.narrow(0, self.row_start, num_rows))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)  # [num_tokens, hidden]
        local_ids = input_ids - self.row_start
        outside = (local_ids < 0) | (local_ids >= self.rows_per_rank)
        embedded = F.embedding(local_ids.masked_fill(outside, 0), self.weight)
        embedded.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(embedded)  # [num_tokens, hidden]


class ParallelLMHead(VocabParallelEmbedding):
    """Hidden states → full-vocab logits (gathered on every rank). ``linear_method``: a
    quantised product (``layers/cpu_quant.py``), as on the linear layers."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup) -> None:
        super().__init__(vocab_size, hidden_size, tp)
        self.linear_method: LinearMethod | None = None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.linear_method is None:
            logits = F.linear(hidden, self.weight)  # [num_rows, rows_per_rank]
        else:
            logits = self.linear_method.apply(self, hidden)
        logits = self.tp.all_gather_last_dim(logits)  # [num_rows, padded_vocab]
        return logits[:, : self.vocab_size]
