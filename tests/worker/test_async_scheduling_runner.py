"""Async scheduling through the real engine core and the real model runner (in one
process, on the CPU): greedy outputs are identical with and without it, whatever ends a
request mid-flight (max_tokens, a stop token, EOS, an abort), under preemption in a tiny
KV cache, with prefix hits and an id reused at once; and the async runs really feed each
step's sampled ids to the next step on the device (``ModelRunner._feed_previous_tokens``).
The embedded SmolLM2 serves the short run; a tiny random Llama the long ones (a SmolLM2
step costs this CPU tens of milliseconds).

The executor here is the worker loop in miniature: ``submit`` runs the step at once with
a deferred output (as the driver worker does) and ``collect`` resolves the oldest.
"""

from __future__ import annotations

import random
from collections import deque

import pytest
import torch

from vtllm.config import VtllmConfig
from vtllm.engine_core.core import EngineCore, EngineFacts
from vtllm.protocol import messages as m
from vtllm.worker.input_batch import RequestStates
from vtllm.worker.model_runner import ModelRunner
from vtllm.worker.runner_output import DeferredOutput

from .tiny_models import make_hf_model

BLOCK_SIZE = 4
MAX_MODEL_LEN = 96


class InProcessExecutor:
    def __init__(self, runner: ModelRunner, defer: bool) -> None:
        self.runner = runner
        self.defer = defer
        self.pending: deque[m.ModelRunnerOutput | DeferredOutput] = deque()

    def submit(self, step: m.SchedulerOutput) -> None:
        self.pending.append(self.runner.execute(step, defer_output=self.defer))

    def collect(self) -> m.ModelRunnerOutput:
        output = self.pending.popleft()
        return output.resolve() if isinstance(output, DeferredOutput) else output

    def compile_grammar(self, request_id, seq, spec) -> None:  # pragma: no cover
        raise AssertionError("no grammars here")

    def release_grammars(self, request_ids) -> None:
        pass

    def take_grammar_results(self, wait_s: float = 0.0) -> list:
        return []


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    return ModelRunner.from_model_dir(smollm2_dir, torch.device("cpu"), torch.float32, seed=0)


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_async")
    make_hf_model("llama_tied", path, seed=1)
    return ModelRunner.from_model_dir(path, torch.device("cpu"), torch.float32, seed=0)


def _run(
    runner: ModelRunner,
    async_scheduling: bool,
    requests: list[tuple[str, list[int], m.SamplingParams]],
    num_blocks: int = 64,
    abort_after: dict[str, int] | None = None,  # request id → abort after N of its tokens
    add_later: dict[int, tuple[str, list[int], m.SamplingParams]] | None = None,  # at step
    graphs: bool = False,
) -> tuple[dict[str, list[int]], dict[str, m.FinishReason], EngineCore, int]:
    """Run ``requests`` to the end; (tokens, finish reasons, the core, tokens fed).
    ``graphs``: decode steps through decode graphs (on a CPU their eager padded path,
    whose int32 input buffer the sampled ids are fed into)."""
    abort_after, add_later = dict(abort_after or {}), dict(add_later or {})
    runner.init_kv_cache(num_blocks, BLOCK_SIZE)  # a fresh cache: no state from a run before
    backend = runner.attention_backend
    if graphs:
        runner.attention_backend = "triton"  # the kernels' contract (torch reference on CPU)
        platform = runner.platform
        runner.capture_decode_graphs(platform, 8, MAX_MODEL_LEN, platform.supports_graphs)
    runner.states = RequestStates(runner._make_generator)
    runner._last_sampled, runner._last_sampled_rows = None, {}
    fed = [0]
    feed = runner._feed_previous_tokens

    def counting_feed(input_ids, batch):
        fed[0] += len(batch.prev_token_dst)
        feed(input_ids, batch)

    runner._feed_previous_tokens = counting_feed
    config = VtllmConfig()
    config.cache.block_size = BLOCK_SIZE
    config.scheduler.async_scheduling = async_scheduling
    config.scheduler.max_num_batched_tokens = 64
    config.scheduler.long_prefill_token_threshold = 0
    eos = tuple(runner.eos_token_ids)
    facts = EngineFacts("smollm2", MAX_MODEL_LEN, runner.vocab_size, num_blocks, BLOCK_SIZE, eos)
    core = EngineCore(config, facts, InProcessExecutor(runner, defer=async_scheduling))
    tokens: dict[str, list[int]] = {}
    finished: dict[str, m.FinishReason] = {}

    def add(request_id: str, prompt: list[int], params: m.SamplingParams) -> None:
        assert core.add_request(b"c", m.AddRequest(request_id, prompt, params)) == []
        tokens[request_id] = []  # a reused id: the outputs of its new life
        finished.pop(request_id, None)

    for request in requests:
        add(*request)
    try:
        for step in range(2000):
            if step in add_later:
                add(*add_later.pop(step))
            if not core.has_work() and not add_later:
                return tokens, finished, core, fed[0]
            outputs, _ = core.step()
            for _, output in outputs:
                assert output.request_id not in finished, f"{output.request_id}: after its end"
                tokens[output.request_id].extend(output.new_token_ids)
                if output.finish_reason is not None:
                    assert output.error is None, output.error
                    finished[output.request_id] = output.finish_reason
            for request_id, num in list(abort_after.items()):
                if len(tokens[request_id]) >= num and request_id not in finished:
                    for _, output in core.abort([request_id]):
                        finished[output.request_id] = output.finish_reason
                    del abort_after[request_id]
        raise AssertionError("the engine did not finish")
    finally:
        runner._feed_previous_tokens = feed
        runner.attention_backend = backend


def _prompt(seed: int, length: int, vocab_size: int = 256) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab_size) for _ in range(length)]


def _greedy(max_tokens: int, **kw) -> m.SamplingParams:
    return m.SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def _assert_same(runner: ModelRunner, **kw) -> tuple[dict, dict, EngineCore]:
    """Sync and async runs of the same workload agree; returns the sync outputs and the
    async run's core."""
    sync_tokens, sync_finished, _, sync_fed = _run(runner, False, **kw)
    async_tokens, async_finished, core, async_fed = _run(runner, True, **kw)
    assert async_tokens == sync_tokens
    assert async_finished == sync_finished
    assert sync_fed == 0 and async_fed > 0
    pool = core.scheduler.kv.pool
    assert pool.num_free_blocks == pool.num_usable_blocks
    assert core.scheduler.requests == {} and not core.has_work()
    return sync_tokens, sync_finished, core


def test_smollm2_greedy_identical_with_max_tokens_and_stop_token(smollm2):
    prompt = _prompt(7, 9, smollm2.vocab_size)
    free, _, _, _ = _run(smollm2, False, [("s", prompt, _greedy(6, ignore_eos=True))])
    stop = free["s"][3]  # ends "s" mid-flight: the step after it is already scheduled
    first = free["s"].index(stop)
    requests = [
        ("s", prompt, _greedy(6, ignore_eos=True, stop_token_ids=[stop])),
        ("one", _prompt(8, 5, smollm2.vocab_size), _greedy(1)),
        ("eos", _prompt(9, 6, smollm2.vocab_size), _greedy(5)),
    ]
    tokens, finished, _ = _assert_same(smollm2, requests=requests)
    assert tokens["s"] == free["s"][: first + 1]
    assert finished["s"] == m.FinishReason.STOP
    assert len(tokens["one"]) == 1 and finished["one"] == m.FinishReason.LENGTH


def test_greedy_outputs_identical_with_max_tokens_and_eos(runner):
    requests = [
        (f"r{i}", _prompt(i, 5 + 7 * i), _greedy(max_tokens))
        for i, max_tokens in enumerate([1, 2, 9, 23])
    ]
    tokens, finished, _ = _assert_same(runner, requests=requests)
    assert [len(tokens[f"r{i}"]) for i in range(2)] == [1, 2]
    assert finished["r0"] == finished["r1"] == m.FinishReason.LENGTH


def test_stop_token_mid_flight_drops_the_extra_token(runner):
    prompt = _prompt(7, 11)
    free, _, _, _ = _run(runner, False, [("s", prompt, _greedy(12, ignore_eos=True))])
    stop = free["s"][4]
    first = free["s"].index(stop)
    params = _greedy(12, ignore_eos=True, stop_token_ids=[stop])
    others = [(f"o{i}", _prompt(20 + i, 6), _greedy(10)) for i in range(2)]
    tokens, finished, _ = _assert_same(runner, requests=[("s", prompt, params), *others])
    assert tokens["s"] == free["s"][: first + 1]
    assert finished["s"] == m.FinishReason.STOP


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "decode-graph-path"])
def test_preemption_prefix_hits_abort_and_id_reuse(runner, graphs):
    shared = _prompt(3, 12)
    requests = [
        ("a", shared + _prompt(4, 3), _greedy(20, ignore_eos=True)),
        ("b", _prompt(5, 9), _greedy(20, ignore_eos=True)),
        ("c", _prompt(6, 14), _greedy(16, ignore_eos=True)),
        ("gone", _prompt(8, 6), _greedy(30, ignore_eos=True)),
    ]
    later = {
        # a prefix hit on "a"'s blocks, and an id reused right after its first life ended
        14: ("d", shared + _prompt(9, 2), _greedy(6, ignore_eos=True)),
        30: ("gone", _prompt(10, 5), _greedy(4, ignore_eos=True)),
    }
    # 15 usable blocks of 4 tokens: four requests of ~30 tokens must take turns
    tokens, finished, core = _assert_same(
        runner,
        requests=requests,
        num_blocks=16,
        abort_after={"gone": 3},
        add_later=later,
        graphs=graphs,
    )
    assert finished["gone"] == m.FinishReason.LENGTH and len(tokens["gone"]) == 4
    assert core.scheduler.num_preemptions_total > 0
    assert core.counters.prefix_hits > 0


@pytest.mark.gpu
def test_gpu_async_outputs_identical_through_decode_graphs(tmp_path):
    """On a GPU: real decode graphs, the deferred device→host copy and the event."""
    path = tmp_path / "tiny"
    make_hf_model("llama_tied", path, seed=1)
    gpu = ModelRunner.from_model_dir(path, torch.device("cuda"), torch.float32, seed=0)
    requests = [
        (f"r{i}", _prompt(i, 4 + 5 * i), _greedy(max_tokens, ignore_eos=True))
        for i, max_tokens in enumerate([1, 3, 17, 30, 12])
    ]
    for graphs in (False, True):
        _assert_same(gpu, requests=requests, num_blocks=24, graphs=graphs)
