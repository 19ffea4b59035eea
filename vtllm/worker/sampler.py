"""Token sampling, vectorised over the batch.

Order of operations per row: temperature → top-k → top-p → min-p → draw. A row with
temperature 0 is greedy (argmax of the raw logits). Random rows draw by the
exponential race ``argmax(p / E)``, ``E ~ Exp(1)`` per token, which samples exactly
from ``p``; the noise of a seeded request comes from its own generator (one ``[vocab]``
draw per sampled token), so its tokens depend only on its seed and its own history,
never on the rest of the batch. Unseeded rows share one generator.

Logprobs are of the model's raw distribution (``log_softmax`` of the logits, before
temperature and truncation).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vtllm.protocol.messages import SamplingParams


@dataclass
class SamplingBatch:
    """Per-row sampling parameters of one step, built on the host once per step."""

    temperature: torch.Tensor  # [num_rows] float32; 0 = greedy
    top_k: torch.Tensor | None  # [num_rows] int64; vocab size = off; None = off for all
    top_p: torch.Tensor | None  # [num_rows] float32; None = off for all
    min_p: torch.Tensor | None  # [num_rows] float32; None = off for all
    all_greedy: bool
    generators: dict[int, torch.Generator]  # row → its request's own generator
    max_num_logprobs: int | None  # None = no logprobs for any row

    @classmethod
    def from_params(
        cls,
        params: list[SamplingParams],
        generators: dict[int, torch.Generator],
        vocab_size: int,
        device: torch.device,
    ) -> SamplingBatch:
        temperature = [max(p.temperature, 0.0) for p in params]
        top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
        top_p = [p.top_p if 0.0 < p.top_p < 1.0 else 1.0 for p in params]
        min_p = [p.min_p for p in params]
        logprobs = [p.logprobs for p in params if p.logprobs is not None]

        def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        return cls(
            temperature=tensor(temperature, torch.float32),
            top_k=tensor(top_k, torch.int64) if any(k < vocab_size for k in top_k) else None,
            top_p=tensor(top_p, torch.float32) if any(p < 1.0 for p in top_p) else None,
            min_p=tensor(min_p, torch.float32) if any(p > 0.0 for p in min_p) else None,
            all_greedy=all(t == 0.0 for t in temperature),
            generators=generators,
            max_num_logprobs=max(logprobs) if logprobs else None,
        )


@dataclass
class SamplerOutput:
    sampled: torch.Tensor  # [num_rows] int64
    logprobs: torch.Tensor | None  # [num_rows] float32, of the sampled token
    top_ids: torch.Tensor | None  # [num_rows, max_num_logprobs] int64
    top_logprobs: torch.Tensor | None  # [num_rows, max_num_logprobs] float32


def exponential_noise(vocab_size: int, generator: torch.Generator) -> torch.Tensor:
    """One request's noise for one draw: ``[vocab]`` Exp(1) samples."""
    return torch.empty(vocab_size, device=generator.device).exponential_(generator=generator)


def advance_generator(generator: torch.Generator, vocab_size: int, num_draws: int) -> None:
    """Skip ``num_draws`` draws, so a request resumed after preemption continues the
    stream it would have followed had it never been preempted."""
    for _ in range(num_draws):
        exponential_noise(vocab_size, generator)


class Sampler:
    """Picks one token per row. Holds only the shared generator (seeded once)."""

    def __init__(self, seed: int, device: torch.device) -> None:
        self.shared_generator = torch.Generator(device=device)
        self.shared_generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """``logits`` ``[num_rows, vocab]`` (any float dtype) → one token per row."""
        logits = logits.float()
        greedy = logits.argmax(dim=-1)  # [num_rows]
        if batch.all_greedy:
            sampled = greedy
        else:
            probs = self._truncated_probs(logits, batch)  # [num_rows, vocab]
            noise = self._noise(probs.shape, batch.generators, probs.device)
            drawn = (probs / noise).argmax(dim=-1)
            sampled = torch.where(batch.temperature == 0.0, greedy, drawn)
        if batch.max_num_logprobs is None:
            return SamplerOutput(sampled, None, None, None)
        logprobs = torch.log_softmax(logits, dim=-1)  # [num_rows, vocab]
        chosen = logprobs.gather(1, sampled.unsqueeze(1)).squeeze(1)
        top_logprobs, top_ids = logprobs.topk(batch.max_num_logprobs, dim=-1)
        return SamplerOutput(sampled, chosen, top_ids, top_logprobs)

    def _truncated_probs(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        temperature = torch.where(batch.temperature == 0.0, 1.0, batch.temperature)
        logits = logits / temperature.unsqueeze(1)
        if batch.top_k is not None or batch.top_p is not None:
            logits = _apply_top_k_top_p(logits, batch.top_k, batch.top_p)
        probs = torch.softmax(logits, dim=-1)
        if batch.min_p is not None:
            threshold = batch.min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < threshold, 0.0)
        return probs

    def _noise(
        self, shape: torch.Size, generators: dict[int, torch.Generator], device: torch.device
    ) -> torch.Tensor:
        noise = torch.empty(shape, device=device)
        if len(generators) < shape[0]:
            noise.exponential_(generator=self.shared_generator)
        for row, generator in generators.items():
            noise[row] = exponential_noise(shape[1], generator)
        return noise


def _apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k and top-p nucleus; the most likely
    token always survives."""
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)  # [rows, vocab]
    remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_k is not None:
        ranks = torch.arange(logits.shape[1], device=logits.device)
        remove |= ranks.unsqueeze(0) >= top_k.unsqueeze(1)
    if top_p is not None:
        sorted_probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        remove |= mass_before > top_p.unsqueeze(1)
    remove[:, 0] = False
    mask = torch.zeros_like(remove).scatter(1, sorted_idx, remove)
    return logits.masked_fill(mask, float("-inf"))
