"""Sampler: greedy, truncation rules, per-request seeds, logprobs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vtllm.protocol.messages import SamplingParams
from vtllm.worker.sampler import Sampler, SamplingBatch, TokenHistory

VOCAB = 50
CPU = torch.device("cpu")


@dataclass
class _Request:
    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams


def _sample(logits, params, generators=None, seed=0):
    batch = SamplingBatch.from_params(params, generators or {}, VOCAB, CPU)
    return Sampler(seed, CPU)(logits, batch)


def _logits(num_rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax():
    logits = _logits(6)
    out = _sample(logits, [SamplingParams(temperature=0.0)] * 6)
    assert out.sampled.tolist() == logits.argmax(-1).tolist()


def test_greedy_rows_stay_greedy_in_a_random_batch():
    logits = _logits(4)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)] * 2
    out = _sample(logits, params)
    assert out.sampled[0::2].tolist() == logits[0::2].argmax(-1).tolist()


def test_a_temperature_below_the_greedy_epsilon_is_greedy():
    """1e-38 passes the range [0, 2] but overflows logits / T: it must act as 0 (greedy),
    not draw from NaN probabilities (which gave token 0 every time)."""
    logits = _logits(6, seed=3)
    assert (logits.argmax(-1) != 0).all()
    for tiny in (1e-38, 1e-30, 1e-6):
        params = [SamplingParams(temperature=tiny), SamplingParams(temperature=1.0)] * 3
        for seed in range(3):
            out = _sample(logits, params, seed=seed)
            assert out.sampled[0::2].tolist() == logits[0::2].argmax(-1).tolist(), tiny
        all_tiny = _sample(logits, [SamplingParams(temperature=tiny)] * 6)
        assert all_tiny.sampled.tolist() == logits.argmax(-1).tolist()
    # at and above the epsilon it samples: a flat-ish row is not always its argmax
    flat = torch.zeros(1, VOCAB)
    flat[0, 7] = 1e-5
    drawn = {
        _sample(flat, [SamplingParams(temperature=1e-5)], seed=s).sampled.item() for s in range(20)
    }
    assert len(drawn) > 1


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = _logits(8, seed=1)
    argmax = logits.argmax(-1).tolist()
    for params in (SamplingParams(temperature=1.5, top_k=1), SamplingParams(top_p=1e-6)):
        for seed in range(5):
            assert _sample(logits, [params] * 8, seed=seed).sampled.tolist() == argmax


def test_top_k_keeps_only_the_k_best():
    logits = torch.zeros(1, VOCAB)
    logits[0, [3, 7, 11]] = torch.tensor([2.0, 1.9, 1.8])
    drawn = {
        _sample(logits, [SamplingParams(temperature=5.0, top_k=3)], seed=s).sampled.item()
        for s in range(60)
    }
    assert drawn == {3, 7, 11}


def test_min_p_drops_unlikely_tokens():
    logits = torch.full((1, VOCAB), -10.0)
    logits[0, 4] = 5.0
    logits[0, 9] = 5.0 + torch.log(torch.tensor(0.3)).item()  # 0.3 x the top probability
    low = {_sample(logits, [SamplingParams(min_p=0.2)], seed=s).sampled.item() for s in range(80)}
    high = {_sample(logits, [SamplingParams(min_p=0.5)], seed=s).sampled.item() for s in range(40)}
    assert low == {4, 9}
    assert high == {4}


def _seeded_run(seed: int, logits_rows, row: int, num_rows: int) -> list[int]:
    """Sample 20 steps for one seeded request placed at ``row`` of a batch."""
    generator = torch.Generator().manual_seed(seed)
    sampler = Sampler(1234, CPU)
    tokens = []
    for step in range(20):
        logits = logits_rows[step].expand(num_rows, VOCAB).clone()
        params = [SamplingParams(temperature=1.0)] * num_rows
        params[row] = SamplingParams(temperature=1.0, seed=seed)
        batch = SamplingBatch.from_params(params, {row: generator}, VOCAB, CPU)
        tokens.append(sampler(logits, batch).sampled[row].item())
    return tokens


def test_same_seed_same_tokens_regardless_of_batch():
    logits_rows = torch.zeros(20, 1, VOCAB)  # uniform: every token equally likely
    alone = _seeded_run(7, logits_rows, row=0, num_rows=1)
    with_others = _seeded_run(7, logits_rows, row=2, num_rows=5)
    assert alone == with_others
    assert _seeded_run(8, logits_rows, row=0, num_rows=1) != alone


def test_unseeded_rows_follow_the_shared_generator():
    logits = torch.zeros(3, VOCAB)
    params = [SamplingParams(temperature=1.0)] * 3
    a = _sample(logits, params, seed=1).sampled.tolist()
    assert a == _sample(logits, params, seed=1).sampled.tolist()
    assert a != _sample(logits, params, seed=2).sampled.tolist()


def test_logprobs_are_log_softmax():
    logits = _logits(3, seed=4)
    params = [
        SamplingParams(temperature=0.0, logprobs=5),
        SamplingParams(temperature=0.7, logprobs=0),
        SamplingParams(temperature=0.0),
    ]
    out = _sample(logits, params)
    expected = torch.log_softmax(logits, -1)
    chosen = expected.gather(1, out.sampled[:, None]).squeeze(1)
    torch.testing.assert_close(out.logprobs, chosen)
    top_values, top_ids = expected.topk(5, -1)
    assert out.top_ids.tolist() == top_ids.tolist()
    torch.testing.assert_close(out.top_logprobs, top_values)


def test_no_logprobs_unless_asked():
    out = _sample(_logits(2), [SamplingParams(temperature=0.0)] * 2)
    assert out.logprobs is None and out.top_ids is None


def test_plain_rows_sample_exactly_the_exponential_race():
    """With no bias, min_tokens or penalties the draw is bit-for-bit the reference:
    ``argmax(softmax(logits / t) / E)``, E from the shared generator in row-major order."""
    logits = _logits(5, seed=3)
    temperature = torch.tensor([0.7, 1.0, 1.3, 0.5, 2.0])
    params = [SamplingParams(temperature=t) for t in temperature.tolist()]
    noise = torch.empty(5, VOCAB).exponential_(generator=torch.Generator().manual_seed(11))
    expected = (torch.softmax(logits / temperature[:, None], -1) / noise).argmax(-1)
    assert _sample(logits, params, seed=11).sampled.tolist() == expected.tolist()
    history = TokenHistory(VOCAB, CPU)
    requests = [_Request(str(i), [1, 2, 3], 2, p) for i, p in enumerate(params)]
    batch = SamplingBatch.from_requests(requests, {}, VOCAB, CPU, [2], history)
    assert Sampler(11, CPU)(logits, batch).sampled.tolist() == expected.tolist()
