"""Token sampling, vectorised over the batch.

Order of operations per row, as in vLLM::

    logit_bias → min_tokens → repetition penalty → presence/frequency penalties
      → temperature → top-k → top-p → min-p → draw

* ``logit_bias`` adds each request's ``{token id: bias}`` to its logits.
* ``min_tokens`` sets the request's stop ids to -inf while it has fewer than
  ``min_tokens`` outputs. Stop ids are ``stop_token_ids`` plus the model's EOS ids; with
  ``ignore_eos`` EOS is no stop (the engine does not finish on it), so only
  ``stop_token_ids`` are masked.
* ``repetition_penalty`` (HF semantics) divides the positive logits and multiplies the
  negative ones of every token seen in the prompt or the outputs.
* ``presence_penalty`` / ``frequency_penalty`` (OpenAI semantics) subtract
  ``presence * (count > 0) + frequency * count``, ``count`` over output tokens only.

A row with temperature 0 is greedy (argmax of the processed logits), and so is one below
``limits.GREEDY_TEMPERATURE`` (1e-5; ``limits.effective_temperature`` decides it): dividing
logits by 1e-38 overflows float32 to inf and NaN, and the draw would be garbage. Random rows draw by
the exponential race ``argmax(p / E)``, ``E ~ Exp(1)`` per token, which samples exactly
from ``p``; the noise of a seeded request comes from its own generator (one ``[vocab]``
draw per sampled token), so its tokens depend only on its seed and its own history,
never on the rest of the batch. Unseeded rows share one generator.

Logprobs are of the model's raw distribution (``log_softmax`` of the logits, before
bias, penalties, temperature and truncation), which is what vLLM returns by default.

Penalties need each request's token statistics on the device. ``TokenHistory`` keeps
them only for the requests that use penalties, updated with just the tokens appended
since the request last sampled; a batch where no row uses bias, min_tokens or penalties
does none of this work and samples exactly as without these features.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from vtllm.protocol.limits import effective_temperature
from vtllm.protocol.messages import SamplingParams


class RequestTokens(Protocol):
    """What the sampler reads of a request besides its params (``RequestState`` fits)."""

    request_id: str
    token_ids: list[int]  # prompt + every output so far; read, never changed
    num_prompt_tokens: int
    sampling_params: SamplingParams


@dataclass
class Penalties:
    """The batch rows that use repetition/presence/frequency penalties, with their token
    statistics gathered from ``TokenHistory``. A factor left None is off for all rows."""

    rows: torch.Tensor | None  # [num_penalised] int64, rows of the batch; None = all rows
    output_counts: torch.Tensor  # [num_penalised, vocab] float32, outputs so far
    seen_mask: torch.Tensor  # [num_penalised, vocab] bool, in the prompt or the outputs
    repetition: torch.Tensor | None  # [num_penalised] float32; 1 = off
    presence: torch.Tensor | None  # [num_penalised] float32; 0 = off
    frequency: torch.Tensor | None  # [num_penalised] float32; 0 = off


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
    # Sparse entries address ``logits.view(-1)``: flat index = row * vocab + token id.
    # ([n] int64 flat index, [n] float32 bias); None = no bias in any row
    logit_bias: tuple[torch.Tensor, torch.Tensor] | None = None
    min_tokens_mask: torch.Tensor | None = None  # [n] int64 flat index, set to -inf
    penalties: Penalties | None = None
    # structured outputs: ([num_masked] int64 rows, [num_masked, ceil(vocab / 32)] int32
    # packed bitmask, bit t % 32 of word t // 32 set = token t allowed); None = no grammar
    grammar_mask: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def from_params(
        cls,
        params: list[SamplingParams],
        generators: dict[int, torch.Generator],
        vocab_size: int,
        device: torch.device,
    ) -> SamplingBatch:
        """A batch from params alone. ``min_tokens`` and penalties need each request's
        tokens: rows that ask for them are refused (use ``from_requests``)."""
        needy = [i for i, p in enumerate(params) if p.min_tokens > 0 or _uses_penalties(p)]
        if needy:
            raise ValueError(
                f"rows {needy[:5]} use min_tokens or penalties, which need each request's "
                "tokens; build the batch with SamplingBatch.from_requests"
            )
        return cls._from_params(params, generators, vocab_size, device)

    @classmethod
    def from_requests(
        cls,
        requests: Sequence[RequestTokens],
        generators: dict[int, torch.Generator],
        vocab_size: int,
        device: torch.device,
        eos_token_ids: Sequence[int],
        history: TokenHistory,
    ) -> SamplingBatch:
        """A batch with every feature; updates ``history`` with the rows' new tokens."""
        batch = cls._from_params(
            [r.sampling_params for r in requests], generators, vocab_size, device
        )
        batch.min_tokens_mask = _min_tokens_mask(requests, eos_token_ids, vocab_size, device)
        batch.penalties = history.penalties(requests)
        return batch

    @classmethod
    def _from_params(
        cls,
        params: list[SamplingParams],
        generators: dict[int, torch.Generator],
        vocab_size: int,
        device: torch.device,
    ) -> SamplingBatch:
        temperature = [effective_temperature(p.temperature) for p in params]
        top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
        top_p = [p.top_p if 0.0 < p.top_p < 1.0 else 1.0 for p in params]
        min_p = [p.min_p for p in params]
        logprobs = [p.logprobs for p in params if p.logprobs is not None]

        def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
            return to_device(values, dtype, device)

        return cls(
            temperature=tensor(temperature, torch.float32),
            top_k=tensor(top_k, torch.int64) if any(k < vocab_size for k in top_k) else None,
            top_p=tensor(top_p, torch.float32) if any(p < 1.0 for p in top_p) else None,
            min_p=tensor(min_p, torch.float32) if any(p > 0.0 for p in min_p) else None,
            all_greedy=all(t == 0.0 for t in temperature),
            generators=generators,
            max_num_logprobs=max(logprobs) if logprobs else None,
            logit_bias=_logit_bias(params, vocab_size, device),
        )


def to_device(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a device tensor. To a GPU it goes from pinned memory without
    blocking: a plain copy would wait for the whole step's forward to finish."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    host = torch.tensor(values, dtype=dtype, pin_memory=True)
    return host.to(device, non_blocking=True)


def _uses_penalties(params: SamplingParams) -> bool:
    return (
        params.repetition_penalty != 1.0
        or params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
    )


def _logit_bias(
    params: list[SamplingParams], vocab_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor] | None:
    flat_index: list[int] = []
    biases: list[float] = []
    for row, p in enumerate(params):
        if p.logit_bias:
            flat_index.extend(row * vocab_size + t for t in p.logit_bias)
            biases.extend(p.logit_bias.values())
    if not flat_index:
        return None
    return to_device(flat_index, torch.int64, device), to_device(biases, torch.float32, device)


def _min_tokens_mask(
    requests: Sequence[RequestTokens],
    eos_token_ids: Sequence[int],
    vocab_size: int,
    device: torch.device,
) -> torch.Tensor | None:
    flat_index: list[int] = []
    for row, request in enumerate(requests):
        p = request.sampling_params
        num_outputs = len(request.token_ids) - request.num_prompt_tokens
        if num_outputs < p.min_tokens:
            stop_ids = [*p.stop_token_ids, *(() if p.ignore_eos else eos_token_ids)]
            flat_index.extend(row * vocab_size + t for t in stop_ids)
    return to_device(flat_index, torch.int64, device) if flat_index else None


class TokenHistory:
    """Device-side token statistics of the requests that use penalties, one slot (row)
    per request, kept across steps and brought up to date when the request samples::

        slot             0         1         2 (free)
        output_counts    [vocab]   [vocab]   ...     float32: times each token was output
        seen_mask        [vocab]   [vocab]   ...     bool: in the prompt or the outputs

    A request's first sampling step scatters its prompt (and any outputs it was resumed
    with) once; later steps add only the tokens appended since. The tensors grow by
    doubling and are freed when no tracked request is left.
    """

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._entries: dict[str, tuple[int, int]] = {}  # request id → (slot, num counted)
        self._free_slots: list[int] = []
        self._reset()

    def __len__(self) -> int:
        return len(self._entries)

    def retain(self, live_request_ids: Container[str]) -> None:
        """Forget every tracked request not in ``live_request_ids``."""
        for request_id in [r for r in self._entries if r not in live_request_ids]:
            self._free_slots.append(self._entries.pop(request_id)[0])
        if not self._entries:
            self._reset()

    def penalties(self, requests: Sequence[RequestTokens]) -> Penalties | None:
        """Update the rows that use penalties and gather their statistics (None when no
        row does: then nothing is touched)."""
        rows = [i for i, r in enumerate(requests) if _uses_penalties(r.sampling_params)]
        if not rows:
            return None
        params = [requests[i].sampling_params for i in rows]
        slots = self._update([requests[i] for i in rows])
        factors = to_device(
            [
                [p.repetition_penalty for p in params],
                [p.presence_penalty for p in params],
                [p.frequency_penalty for p in params],
            ],
            torch.float32,
            self.device,
        )  # [3, num_penalised]
        all_rows = rows == list(range(len(requests)))
        return Penalties(
            rows=None if all_rows else to_device(rows, torch.int64, self.device),
            output_counts=self.output_counts.index_select(0, slots),
            seen_mask=self.seen_mask.index_select(0, slots),
            repetition=factors[0] if any(p.repetition_penalty != 1.0 for p in params) else None,
            presence=factors[1] if any(p.presence_penalty != 0.0 for p in params) else None,
            frequency=factors[2] if any(p.frequency_penalty != 0.0 for p in params) else None,
        )

    def _update(self, requests: list[RequestTokens]) -> torch.Tensor:
        """Count each request's tokens not yet counted; returns ``[len]`` int64 slots."""
        self._ensure_free_slots(sum(r.request_id not in self._entries for r in requests))
        slots: list[int] = []
        fresh_slots: list[int] = []
        prompt_index: list[int] = []  # flat: slot * vocab + token id
        output_index: list[int] = []
        for request in requests:
            tokens = request.token_ids
            slot, num_counted = self._entries.get(request.request_id, (-1, 0))
            if slot < 0 or num_counted > len(tokens):  # new, or re-sent with fewer tokens
                slot = self._free_slots.pop() if slot < 0 else slot
                fresh_slots.append(slot)
                num_counted = request.num_prompt_tokens
                offset = slot * self.vocab_size
                prompt_index.extend(offset + t for t in tokens[:num_counted])
            offset = slot * self.vocab_size
            output_index.extend(offset + t for t in tokens[num_counted:])
            self._entries[request.request_id] = (slot, len(tokens))
            slots.append(slot)
        # flat index_fill_/index_add_: one kernel each, unlike 2-D index_put_
        if fresh_slots:
            fresh = to_device(fresh_slots, torch.int64, self.device)
            self.output_counts.index_fill_(0, fresh, 0.0)
            self.seen_mask.index_fill_(0, fresh, False)
        if prompt_index:
            index = to_device(prompt_index, torch.int64, self.device)
            self.seen_mask.view(-1).index_fill_(0, index, True)
        if output_index:
            index = to_device(output_index, torch.int64, self.device)
            ones = torch.ones(len(output_index), device=self.device)
            self.output_counts.view(-1).index_add_(0, index, ones)
            self.seen_mask.view(-1).index_fill_(0, index, True)
        return to_device(slots, torch.int64, self.device)

    def _reset(self) -> None:
        self._free_slots.clear()
        self.output_counts = torch.zeros((0, self.vocab_size), device=self.device)
        self.seen_mask = torch.zeros((0, self.vocab_size), dtype=torch.bool, device=self.device)

    def _ensure_free_slots(self, num_needed: int) -> None:
        if len(self._free_slots) >= num_needed:
            return
        capacity = self.output_counts.shape[0]
        new_capacity = max(8, 2 * capacity, capacity + num_needed - len(self._free_slots))
        counts, seen = self.output_counts, self.seen_mask
        self.output_counts = counts.new_zeros((new_capacity, self.vocab_size))
        self.output_counts[:capacity] = counts
        self.seen_mask = seen.new_zeros((new_capacity, self.vocab_size))
        self.seen_mask[:capacity] = seen
        self._free_slots.extend(range(new_capacity - 1, capacity - 1, -1))


# per slot and token id: output_counts float32 + seen_mask bool
_STATE_BYTES_PER_ENTRY = 4 + 1
# per penalised row and token id, one step at most: the gathered statistics (5), the
# processed logits' clone (4), apply_penalties' selected rows (4), ``rows > 0`` (1) and
# the three float32 temporaries of the repetition ``where`` (12)
_STEP_BYTES_PER_ENTRY = 5 + 4 + 4 + 1 + 12


def token_history_capacity(max_num_seqs: int) -> int:
    """Most slots ``TokenHistory`` ever holds when at most ``max_num_seqs`` requests are
    tracked: it grows only from fewer than ``max_num_seqs`` slots, to at most
    ``max(8, 2 × capacity, tracked + needed)`` (see ``_ensure_free_slots``)."""
    return max(8, 2 * (max_num_seqs - 1), max_num_seqs)


def penalty_state_bytes(max_num_seqs: int, vocab_size: int) -> int:
    """Device bytes that penalties can hold at once beyond a plain sampling step, with at
    most ``max_num_seqs`` requests in a batch: ``TokenHistory`` at its largest capacity
    plus one step's gathered statistics and temporaries for every row. The worker's
    memory profiling counts this (its dummy step samples without penalties); a grown
    capacity exceeds ``max_num_seqs`` by up to 2×, and while growing the old slots (fewer
    than ``max_num_seqs``) coexist with the new ones, which the step term covers."""
    capacity = token_history_capacity(max_num_seqs)
    per_token = _STATE_BYTES_PER_ENTRY * capacity + _STEP_BYTES_PER_ENTRY * max_num_seqs
    return per_token * vocab_size


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
        """``logits`` ``[num_rows, vocab]`` (any float dtype) → one token per row.
        ``logits`` itself is never changed."""
        raw = logits.float()
        logits = process_logits(raw, batch)  # [num_rows, vocab]; ``raw`` when no-op
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
        logprobs = torch.log_softmax(raw, dim=-1)  # [num_rows, vocab]
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


def process_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """``logits`` ``[num_rows, vocab]`` float32 after bias, min_tokens and penalties: a
    new tensor, or ``logits`` itself when the batch uses none of them."""
    if (
        batch.logit_bias is None
        and batch.min_tokens_mask is None
        and batch.penalties is None
        and batch.grammar_mask is None
    ):
        return logits
    logits = logits.clone(memory_format=torch.contiguous_format)
    flat = logits.view(-1)  # the sparse entries' flat indices address this
    if batch.logit_bias is not None:
        flat.index_add_(0, *batch.logit_bias)
    if batch.min_tokens_mask is not None:
        flat.index_fill_(0, batch.min_tokens_mask, float("-inf"))
    if batch.penalties is not None:
        apply_penalties(logits, batch.penalties)
    if batch.grammar_mask is not None:  # last: no bias or penalty can lift a masked token
        apply_token_bitmask(logits, *batch.grammar_mask)
    return logits


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set to -inf, in place, every token of ``logits`` ``[num_rows, vocab]`` in ``rows``
    ``[num_masked]`` whose bit in ``bitmask`` ``[num_masked, ceil(vocab / 32)]`` int32 is 0
    (xgrammar's packing: token t is bit t % 32 of word t // 32). Runs on the logits'
    device: a shift, an and and a masked fill over ``[num_masked, vocab]``."""
    vocab_size = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [num_masked, words, 32]
    allowed = bits.flatten(1)[:, :vocab_size].bool()  # [num_masked, vocab]
    selected = logits.index_select(0, rows)  # [num_masked, vocab]
    logits.index_copy_(0, rows, selected.masked_fill_(~allowed, float("-inf")))


def apply_penalties(logits: torch.Tensor, penalties: Penalties) -> None:
    """Penalise, in place, the rows of ``logits`` ``[num_rows, vocab]`` in
    ``penalties.rows``: repetition first, then presence and frequency. This runs every
    step, so it makes as few passes over ``[num_penalised, vocab]`` as it can."""
    all_rows = penalties.rows is None
    rows = logits if all_rows else logits.index_select(0, penalties.rows)  # [P, vocab]
    counts = penalties.output_counts  # [P, vocab]
    if penalties.repetition is not None:
        factor = penalties.repetition.unsqueeze(1)  # [P, 1]
        penalised = torch.where(rows > 0, rows / factor, rows * factor)
        torch.where(penalties.seen_mask, penalised, rows, out=rows)
    if penalties.frequency is not None:
        rows.addcmul_(counts, penalties.frequency.unsqueeze(1), value=-1.0)
    if penalties.presence is not None:
        rows.addcmul_(counts.clamp(max=1.0), penalties.presence.unsqueeze(1), value=-1.0)
    if not all_rows:
        logits.index_copy_(0, penalties.rows, rows)


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
