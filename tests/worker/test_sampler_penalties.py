"""Sampler: logit_bias, min_tokens and penalties, against hand-computed references, and
through ``ModelRunner.execute`` with a tiny model (transformers as the reference)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from vtllm.protocol.messages import SamplingParams
from vtllm.worker.model_runner import ModelRunner
from vtllm.worker.sampler import Sampler, SamplingBatch, TokenHistory, process_logits

from .tiny_models import EngineSim, make_hf_model

VOCAB = 8
CPU = torch.device("cpu")
EOS = [2, 3]
INF = float("inf")


@dataclass
class Req:
    request_id: str
    token_ids: list[int]  # prompt + outputs
    num_prompt_tokens: int
    sampling_params: SamplingParams


def _batch(reqs: list[Req], history: TokenHistory | None = None) -> SamplingBatch:
    history = history or TokenHistory(VOCAB, CPU)
    return SamplingBatch.from_requests(reqs, {}, VOCAB, CPU, EOS, history)


def _processed(logits: torch.Tensor, reqs: list[Req]) -> torch.Tensor:
    return process_logits(logits.clone(), _batch(reqs))


LOGITS = torch.tensor([2.0, -1.0, 0.5, -3.0, 1.0, 4.0, -0.5, 0.0])


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    # prompt [0, 1], outputs [2, 6]: seen = {0, 1, 2, 6}
    req = Req("a", [0, 1, 2, 6], 2, SamplingParams(repetition_penalty=2.0))
    expected = torch.tensor([1.0, -2.0, 0.25, -3.0, 1.0, 4.0, -1.0, 0.0])
    torch.testing.assert_close(_processed(LOGITS[None], [req])[0], expected)


def test_presence_and_frequency_count_outputs_only():
    # prompt [5, 4]; outputs: 4 three times, 7 once
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    req = Req("a", [5, 4, 4, 7, 4, 4], 2, params)
    expected = LOGITS.clone()
    expected[4] -= 0.5 + 3 * 0.25
    expected[7] -= 0.5 + 1 * 0.25
    torch.testing.assert_close(_processed(LOGITS[None], [req])[0], expected)


def test_negative_presence_and_frequency_encourage_repeats():
    req = Req("a", [0, 1, 1], 1, SamplingParams(presence_penalty=-1.0, frequency_penalty=-0.5))
    expected = LOGITS.clone()
    expected[1] += 1.0 + 2 * 0.5
    torch.testing.assert_close(_processed(LOGITS[None], [req])[0], expected)


def test_order_is_bias_then_repetition_then_presence():
    # token 5: (4 + 2) / 2 - 1 = 2; the other order would give (4 - 1) / 2 + 2 = 3.5
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=1.0, logit_bias={5: 2.0})
    processed = _processed(LOGITS[None], [Req("a", [0, 5], 1, params)])[0]
    assert processed[5].item() == pytest.approx(2.0)
    assert processed[0].item() == pytest.approx(1.0)  # prompt: repetition only


def test_logit_bias_forces_and_forbids():
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0))
    argmax = logits.argmax(-1)
    force = [SamplingParams(temperature=1.0, logit_bias={6: 100.0})] * 4
    forbid = [SamplingParams(temperature=0.0, logit_bias={int(t): -100.0}) for t in argmax]
    for seed in range(10):
        out = Sampler(seed, CPU)(logits, SamplingBatch.from_params(force, {}, VOCAB, CPU))
        assert out.sampled.tolist() == [6] * 4
    out = Sampler(0, CPU)(logits, SamplingBatch.from_params(forbid, {}, VOCAB, CPU))
    assert (out.sampled != argmax).all()
    assert out.sampled.tolist() == logits.scatter(1, argmax[:, None], -INF).argmax(-1).tolist()


def _min_tokens_row(num_outputs: int, **params) -> list[bool]:
    """Which tokens are masked to -inf for a request with ``num_outputs`` outputs."""
    req = Req("a", [0] * (3 + num_outputs), 3, SamplingParams(**params))
    return (_processed(torch.zeros(1, VOCAB), [req])[0] == -INF).tolist()


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    masked = [t for t in range(VOCAB) if _min_tokens_row(3, min_tokens=4, stop_token_ids=[6])[t]]
    assert masked == [2, 3, 6]
    assert not any(_min_tokens_row(4, min_tokens=4, stop_token_ids=[6]))
    assert not any(_min_tokens_row(9, min_tokens=4, stop_token_ids=[6]))
    assert not any(_min_tokens_row(0, stop_token_ids=[6]))


def test_min_tokens_with_ignore_eos_masks_only_stop_ids():
    masked = _min_tokens_row(0, min_tokens=2, stop_token_ids=[6], ignore_eos=True)
    assert [t for t in range(VOCAB) if masked[t]] == [6]


def test_min_tokens_holds_back_a_dominant_eos_when_sampling():
    logits = torch.zeros(2, VOCAB)
    logits[:, 2] = 50.0  # EOS all but certain
    params = SamplingParams(temperature=1.0, min_tokens=2)
    reqs = [Req("early", [0, 1, 1], 2, params), Req("done", [0, 1, 1, 1], 2, params)]
    for seed in range(10):
        sampled = Sampler(seed, CPU)(logits, _batch(reqs)).sampled.tolist()
        assert sampled[0] not in EOS and sampled[1] == 2


def test_penalties_do_not_leak_between_rows():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(1))
    plain = SamplingParams(temperature=0.0)
    penalised = SamplingParams(
        temperature=0.0, repetition_penalty=3.0, presence_penalty=1.0, frequency_penalty=1.0
    )
    reqs = [
        Req("a", [1, 2, 3, 4], 2, plain),
        Req("b", [1, 2, 3, 4, 5, 5], 2, penalised),
        Req("c", [5, 6, 7], 1, SamplingParams(min_tokens=5, logit_bias={0: 1.0})),
    ]
    processed = _processed(logits, reqs)
    assert torch.equal(processed[0], logits[0])
    alone = _processed(logits[1:2], [reqs[1]])[0]
    assert torch.equal(processed[1], alone)
    expected_c = logits[2].clone()
    expected_c[0] += 1.0
    expected_c[EOS] = -INF
    assert torch.equal(processed[2], expected_c)


def test_history_follows_request_ids_across_steps_and_reuses_slots_clean():
    history = TokenHistory(VOCAB, CPU)
    params = SamplingParams(frequency_penalty=1.0)
    a, b = Req("a", [0, 1, 1], 1, params), Req("b", [2, 3], 1, params)

    def counts(reqs: list[Req]) -> list[list[float]]:
        return history.penalties(reqs).output_counts.tolist()

    assert counts([a, b]) == [[0, 2, 0, 0, 0, 0, 0, 0], [0, 0, 0, 1, 0, 0, 0, 0]]
    a.token_ids.append(4)
    b.token_ids.extend([3, 7])
    assert counts([b, a]) == [[0, 0, 0, 2, 0, 0, 0, 1], [0, 2, 0, 0, 1, 0, 0, 0]]
    history.retain({"b"})  # a finished: its slot is freed
    c = Req("c", [5, 6], 1, params)
    assert counts([c]) == [[0, 0, 0, 0, 0, 0, 1, 0]]  # not a's counts
    assert len(history) == 2
    b.token_ids[:] = [2, 3]  # re-sent from scratch (preempted), fewer tokens than counted
    assert counts([b]) == [[0, 0, 0, 1, 0, 0, 0, 0]]
    history.retain(set())
    assert len(history) == 0 and history.output_counts.shape[0] == 0


def test_history_grows_past_its_first_capacity():
    history = TokenHistory(VOCAB, CPU)
    reqs = [Req(str(i), [0, i % VOCAB], 1, SamplingParams(presence_penalty=1.0)) for i in range(20)]
    got = history.penalties(reqs).output_counts
    assert torch.equal(got, torch.eye(VOCAB)[[i % VOCAB for i in range(20)]])


def test_no_feature_no_work_and_logits_untouched():
    logits = torch.randn(2, VOCAB)
    before = logits.clone()
    history = TokenHistory(VOCAB, CPU)
    plain = _batch([Req("a", [1, 2], 1, SamplingParams())] * 2, history)
    assert plain.logit_bias is None and plain.min_tokens_mask is None and plain.penalties is None
    assert process_logits(logits, plain) is logits and len(history) == 0
    busy = _batch([Req("a", [1, 2], 1, SamplingParams(repetition_penalty=2.0))] * 2)
    Sampler(0, CPU)(logits, busy)
    assert torch.equal(logits, before)


def test_logprobs_stay_raw_under_penalties():
    logits = LOGITS[None].clone()  # argmax 5 (4.0); 0 next (2.0)
    params = SamplingParams(temperature=0.0, logprobs=3, repetition_penalty=5.0)
    out = Sampler(0, CPU)(logits, _batch([Req("a", [5], 1, params)]))
    assert out.sampled.tolist() == [0]  # 5 is penalised to 0.8
    raw = torch.log_softmax(logits, -1)
    torch.testing.assert_close(out.logprobs, raw[:, 0])
    torch.testing.assert_close(out.top_logprobs, raw.topk(3, -1).values)


def test_from_params_refuses_rows_that_need_tokens():
    for params in (SamplingParams(min_tokens=1), SamplingParams(frequency_penalty=0.1)):
        with pytest.raises(ValueError, match="from_requests"):
            SamplingBatch.from_params([params], {}, VOCAB, CPU)


# -- through the model runner ----------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    return path, make_hf_model("llama_tied", path)


def _run(model_dir, requests: dict[str, tuple[list[int], SamplingParams]], num_steps: int):
    runner = ModelRunner.from_model_dir(model_dir, CPU, torch.float32, seed=0)
    runner.init_kv_cache(num_blocks=64, block_size=4)
    engine = EngineSim(runner.execute, num_blocks=64, block_size=4)
    for request_id, (prompt, params) in requests.items():
        engine.add(request_id, prompt, params)
    engine.step({rid: len(prompt) for rid, (prompt, _) in requests.items()})
    for _ in range(num_steps - 1):
        engine.step({rid: 1 for rid in requests})
    outputs = {rid: engine.requests[rid].token_ids[len(p) :] for rid, (p, _) in requests.items()}
    return outputs, runner, engine


@torch.no_grad()
def _hf_greedy(model, prompt: list[int], penalty: float, num_steps: int) -> list[int]:
    import transformers

    processor = transformers.RepetitionPenaltyLogitsProcessor(penalty)
    ids = torch.tensor([prompt])
    for _ in range(num_steps):
        logits = processor(ids, model(ids).logits[:, -1].float())
        ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt) :].tolist()


def test_runner_repetition_penalty_breaks_greedy_loops_like_transformers(tiny):
    model_dir, hf_model = tiny
    prompt = [5, 6, 7, 8]

    def repeats(tokens: list[int]) -> int:
        return sum(t in prompt or t in tokens[:i] for i, t in enumerate(tokens))

    requests = {
        "plain": (prompt, SamplingParams(temperature=0.0)),
        "mild": (prompt, SamplingParams(temperature=0.0, repetition_penalty=2.0)),
        "strong": (prompt, SamplingParams(temperature=0.0, repetition_penalty=10.0)),
    }
    outputs, runner, engine = _run(model_dir, requests, num_steps=10)
    # the random tiny model loops on its last token; a strong penalty stops all repeats
    assert repeats(outputs["plain"]) >= repeats(outputs["mild"]) >= repeats(outputs["strong"])
    assert repeats(outputs["plain"]) >= 5 and repeats(outputs["strong"]) == 0
    for rid, penalty in (("plain", 1.0), ("mild", 2.0), ("strong", 10.0)):
        assert outputs[rid] == _hf_greedy(hf_model, prompt, penalty, 10), rid
    assert len(runner.token_history) == 2
    for rid in requests:
        engine.finish(rid)
    engine.step({})
    assert len(runner.token_history) == 0


def test_runner_min_tokens_holds_back_eos(tiny):
    model_dir, _ = tiny
    prompt = [5, 6, 7, 8]
    requests = {  # the bias makes EOS (2) or the stop id (9) the obvious choice
        "eos": (prompt, SamplingParams(temperature=0.0, min_tokens=4, logit_bias={2: 100.0})),
        "stop_ignore_eos": (
            prompt,
            SamplingParams(
                temperature=0.0,
                min_tokens=3,
                stop_token_ids=[9],
                ignore_eos=True,
                logit_bias={9: 100.0, 2: 50.0},
            ),
        ),
    }
    outputs, _, _ = _run(model_dir, requests, num_steps=6)
    assert all(t not in (2, 3) for t in outputs["eos"][:4]) and outputs["eos"][4:] == [2, 2]
    assert outputs["stop_ignore_eos"] == [2, 2, 2, 9, 9, 9]
