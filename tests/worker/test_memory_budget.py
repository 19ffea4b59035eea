"""The GPU worker's KV budget on CPU: every term from injected memory readings, the
refusal when nothing is left, the sampler's penalty state against a real
``TokenHistory``, and the CPU worker's start-up log."""

from __future__ import annotations

import dataclasses
import logging
import random

import pytest
import torch

from vtllm.config import VtllmConfig
from vtllm.protocol.messages import SamplingParams
from vtllm.worker import worker
from vtllm.worker.memory_budget import GiB, MiB, NoMemoryForKVCache, memory_budget
from vtllm.worker.model_runner import ModelRunner
from vtllm.worker.platform import MemorySnapshot, cpu_platform
from vtllm.worker.sampler import TokenHistory, penalty_state_bytes, token_history_capacity

from .tiny_models import VOCAB_SIZE, make_hf_model

TOTAL = 80 * GiB
CONTEXT = 512 * MiB  # this worker's CUDA context, in use before it loads anything
WEIGHTS = 16 * GiB
PEAK_ACTIVATION = 3 * GiB
GRAPHS = 200 * MiB
SAMPLER = 300 * MiB
COMM = 400 * MiB  # NCCL buffers, kernels: appear outside torch after the start


def _snapshots(other_processes: int = 0, comm: int = COMM, leftover_cache: int = 0):
    """Readings before loading and after profiling (KV freed, cache emptied), with
    ``other_processes`` bytes held by someone else all along."""
    at_start = MemorySnapshot(
        total=TOTAL,
        free=TOTAL - CONTEXT - other_processes,
        torch_reserved=0,
        torch_allocated=0,
        torch_peak_allocated=0,
    )
    reserved = WEIGHTS + leftover_cache
    profiled = MemorySnapshot(
        total=TOTAL,
        free=TOTAL - CONTEXT - other_processes - comm - reserved,
        torch_reserved=reserved,
        torch_allocated=WEIGHTS,
        torch_peak_allocated=WEIGHTS + PEAK_ACTIVATION,
    )
    return at_start, profiled


def _budget(utilization=0.9, **snapshot_args):
    at_start, profiled = _snapshots(**snapshot_args)
    return memory_budget(utilization, at_start, profiled, WEIGHTS, PEAK_ACTIVATION, GRAPHS, SAMPLER)


def test_every_term_is_measured_and_subtracted():
    budget = _budget()
    assert budget.total == TOTAL
    assert budget.limit == int(0.9 * TOTAL)
    assert budget.in_use_at_start == CONTEXT
    assert budget.non_torch_growth == COMM
    assert (budget.weights, budget.peak_activation) == (WEIGHTS, PEAK_ACTIVATION)
    assert (budget.graphs, budget.sampler_state) == (GRAPHS, SAMPLER)
    expected = int(0.9 * TOTAL) - CONTEXT - COMM - WEIGHTS - PEAK_ACTIVATION - GRAPHS - SAMPLER
    assert budget.kv_cache == budget.kv_cache_bytes() == expected


@pytest.mark.parametrize(
    "term", ["weights", "peak_activation", "graphs", "sampler_state", "in_use_at_start"]
)
def test_each_term_costs_the_kv_cache_exactly_its_bytes(term):
    base = _budget()
    bigger = dataclasses.replace(base, **{term: getattr(base, term) + 1 * GiB})
    assert base.kv_cache - bigger.kv_cache == 1 * GiB


def test_other_processes_already_on_the_device_leave_less_kv():
    alone = _budget()
    shared = _budget(other_processes=5 * GiB)
    assert shared.in_use_at_start == CONTEXT + 5 * GiB
    assert shared.non_torch_growth == COMM  # theirs is not counted twice
    assert alone.kv_cache - shared.kv_cache == 5 * GiB


def test_memory_outside_torch_that_appears_while_loading_leaves_less_kv():
    assert _budget(comm=0).kv_cache - _budget(comm=2 * GiB).kv_cache == 2 * GiB


def test_torch_reserved_memory_is_not_mistaken_for_memory_outside_torch():
    # torch's cache held 1 GiB more at the second reading: that is torch's, not growth
    assert _budget(leftover_cache=1 * GiB).non_torch_growth == COMM


def test_memory_freed_by_another_process_meanwhile_makes_no_room():
    at_start, profiled = _snapshots(other_processes=10 * GiB)
    profiled = dataclasses.replace(profiled, free=profiled.free + 8 * GiB)  # they freed 8
    budget = memory_budget(0.9, at_start, profiled, WEIGHTS, PEAK_ACTIVATION, GRAPHS, SAMPLER)
    assert budget.in_use_at_start == CONTEXT + 10 * GiB
    assert budget.non_torch_growth == 0
    assert budget.kv_cache == _budget(other_processes=10 * GiB, comm=0).kv_cache


def test_utilization_caps_the_whole_device():
    assert _budget(0.9).kv_cache - _budget(0.5).kv_cache == int(0.9 * TOTAL) - int(0.5 * TOTAL)


def test_the_log_line_names_every_term_in_gib_or_mib():
    line = _budget().describe()
    for text in (
        "limit 0.90 × 80.00 GiB = 72.00 GiB",
        "in use at start 512 MiB (other processes, CUDA context)",
        "non-torch growth 400 MiB",
        "weights 16.00 GiB",
        "peak activation 3.00 GiB",
        "decode graphs 200 MiB",
        "sampler state 300 MiB",
        "→ KV cache 51.62 GiB",
    ):
        assert text in line
    assert "\n" not in line


def test_nothing_left_is_refused_with_the_numbers_and_the_flag():
    budget = _budget(other_processes=60 * GiB)
    assert budget.kv_cache <= 0
    with pytest.raises(NoMemoryForKVCache) as refusal:
        budget.kv_cache_bytes()
    message = str(refusal.value)
    assert "no device memory is left for the KV cache" in message
    assert "in use at start 60.50 GiB" in message
    assert "KV cache -8.38 GiB" in message
    assert "--gpu-memory-utilization (now 0.90" in message
    assert "--max-num-batched-tokens" in message and "--max-num-seqs" in message


def test_exactly_nothing_left_is_refused_too():
    budget = _budget()
    budget = dataclasses.replace(budget, weights=budget.weights + budget.kv_cache)
    assert budget.kv_cache == 0
    with pytest.raises(NoMemoryForKVCache):
        budget.kv_cache_bytes()


def test_snapshot_counts_what_torch_does_not_hold():
    snapshot = MemorySnapshot(
        total=10 * GiB,
        free=4 * GiB,
        torch_reserved=5 * GiB,
        torch_allocated=3 * GiB,
        torch_peak_allocated=3 * GiB,
    )
    assert snapshot.non_torch == 1 * GiB


def test_cpu_platform_snapshot_reads_ram_and_no_torch_numbers():
    snapshot = cpu_platform().memory_snapshot()
    assert 0 < snapshot.free <= snapshot.total
    assert (snapshot.torch_reserved, snapshot.torch_allocated) == (0, 0)


# -- the sampler's penalty state ------------------------------------------------------


class _Request:
    def __init__(self, request_id: str, num_prompt_tokens: int) -> None:
        self.request_id = request_id
        self.token_ids = [random.randrange(VOCAB_SIZE) for _ in range(num_prompt_tokens)]
        self.num_prompt_tokens = num_prompt_tokens
        self.sampling_params = SamplingParams(repetition_penalty=1.2, frequency_penalty=0.5)


def _held_bytes(history: TokenHistory, penalties) -> int:
    tensors = [history.output_counts, history.seen_mask]
    tensors += [penalties.output_counts, penalties.seen_mask]
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("max_num_seqs", [1, 5, 9, 17, 40])
def test_penalty_state_bound_holds_for_a_real_token_history(max_num_seqs):
    """Requests come and go at random, at most ``max_num_seqs`` at once, arriving a few at
    a time so the slots grow in every pattern; what the history and one step's gathered
    statistics hold never exceeds what the worker counts, and the capacity reaches the
    bound's at least once over these sizes."""
    rng = random.Random(max_num_seqs)
    history = TokenHistory(VOCAB_SIZE, torch.device("cpu"))
    live: list[_Request] = []
    most_held = max_capacity = 0
    for step in range(200):
        for request in rng.sample(live, rng.randint(0, len(live))):
            live.remove(request)
        num_new = rng.randint(0, max_num_seqs - len(live))
        live += [_Request(f"{step}-{i}", rng.randint(1, 8)) for i in range(num_new)]
        history.retain({r.request_id for r in live})
        if not live:
            continue
        penalties = history.penalties(live)
        for request in live:
            request.token_ids.append(rng.randrange(VOCAB_SIZE))
        max_capacity = max(max_capacity, history.output_counts.shape[0])
        most_held = max(most_held, _held_bytes(history, penalties))
    assert max_capacity <= token_history_capacity(max_num_seqs)
    assert most_held <= penalty_state_bytes(max_num_seqs, VOCAB_SIZE)


def test_penalty_state_capacity_bound_is_reached():
    """9 requests: 8 slots fill, the 9th doubles them to 16 = 2 × (9 − 1)."""
    history = TokenHistory(VOCAB_SIZE, torch.device("cpu"))
    requests = [_Request(str(i), 2) for i in range(9)]
    history.penalties(requests[:8])
    history.penalties(requests)
    assert history.output_counts.shape[0] == token_history_capacity(9) == 16


def test_penalty_state_scales_with_max_num_seqs_and_vocab():
    # Qwen3's vocabulary at the default 256 sequences: about 1.3 GiB
    assert penalty_state_bytes(256, 151_936) == (5 * 510 + 26 * 256) * 151_936
    assert penalty_state_bytes(16, 1000) * 2 == penalty_state_bytes(16, 2000)


# -- the worker on CPU ----------------------------------------------------------------


def test_cpu_worker_takes_kv_cache_memory_and_logs_the_sampler_state(tmp_path, caplog):
    make_hf_model("llama", tmp_path)
    runner = ModelRunner.from_model_dir(tmp_path, torch.device("cpu"), torch.float32, seed=0)
    config = VtllmConfig()
    config.cache.kv_cache_memory = 64 * MiB
    config.scheduler.max_num_seqs = 16
    platform = cpu_platform()
    with caplog.at_level(logging.INFO, logger=worker.logger.name):
        usable = worker._usable_kv_bytes(
            config, platform, runner, 256, False, platform.memory_snapshot()
        )
    assert usable == 64 * MiB
    expected_mib = penalty_state_bytes(16, VOCAB_SIZE) / MiB
    assert "KV cache 0.06 GiB (--kv-cache-memory); sampler penalty state up to " in caplog.text
    assert f"{expected_mib:.0f} MiB besides" in caplog.text
