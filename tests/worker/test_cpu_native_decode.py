"""The native CPU decode step (``worker/cpu_native_decode.py``, ``native/cpu_kernels.c``).

Against its plain-torch reference (same repacked weights, float32): logits, hidden states
and the KV cache over decode steps of changing batch sizes, positions and block tables,
for plain, tied, q/k-normed and qkv-biased Llamas; batch-invariant logits; the runner's
routing (decode-only batches up to MAX_NATIVE_ROWS, short prompt chunks one row a token;
long chunks and bigger batches elsewhere) with the same greedy tokens as the torch int4
path; a short chunk computed as its tokens decoded one by one; the embedded SmolLM2's
README answer; refusals (bad ids) and where it does not apply.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vtllm.protocol.messages import SamplingParams
from vtllm.worker import cpu_native_decode, cpu_steps, native_build
from vtllm.worker.cpu_native_decode import NativeDecode, Q4Weight, reference_step
from vtllm.worker.layers import cpu_quant
from vtllm.worker.model_runner import ModelRunner

from .tiny_models import EngineSim, greedy_tokens, make_hf_model, readme_prompt

pytestmark = pytest.mark.skipif(
    native_build.library() is None, reason="no C compiler for the native kernels"
)
BLOCK_SIZE = 4
NUM_BLOCKS = 32


def _runner(model_dir, quantization: str = "int4") -> ModelRunner:
    runner = ModelRunner.from_model_dir(
        model_dir, torch.device("cpu"), torch.float32, seed=0, cpu_quantization=quantization
    )
    runner.init_kv_cache(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    return runner


def test_q4_repacking_keeps_the_int4_weights():
    """The kernel's Q4_1 blocks dequantise to the torch int4 path's weight (bf16 scale and
    zero, float32 arithmetic)."""
    torch.manual_seed(0)
    weight = torch.randn(48, 96)
    _, _, dequantised = cpu_quant.quantize_int4(weight)
    torch.testing.assert_close(
        Q4Weight(weight, None).dequantised(), dequantised.float(), atol=1e-2, rtol=1e-2
    )


def test_the_plain_c_product_matches_its_reference():
    """Built without AVX2 (plain C), the int4 and int8 products equal their torch
    references to float32 rounding, and each row alone gives the same bits as in the
    batch; the int8 one with rows that are not a whole block of 8 (77)."""
    plain = native_build.build(("-mno-avx2", "-mno-fma"))
    assert plain is not None
    torch.manual_seed(5)
    q4 = Q4Weight(torch.randn(80, 320) * 0.05, torch.randn(80))
    x = torch.randn(6, 320)
    got = cpu_native_decode.q4_linear(q4, x, plain)
    torch.testing.assert_close(
        got, cpu_native_decode.q4_linear_reference(q4, x), atol=2e-5, rtol=1e-5
    )
    for r in range(x.shape[0]):
        assert torch.equal(cpu_native_decode.q4_linear(q4, x[r : r + 1], plain), got[r : r + 1])
    q8, scale, _ = cpu_quant.quantize_int8(torch.randn(77, 320) * 0.05)
    scale = scale.float()
    for library in (plain, None):  # plain C, then this CPU's build
        got = cpu_native_decode.q8_linear(q8, scale, x, library)
        torch.testing.assert_close(
            got, cpu_native_decode.q8_linear_reference(q8, scale, x), atol=2e-5, rtol=1e-5
        )
        for r in range(x.shape[0]):
            assert torch.equal(
                cpu_native_decode.q8_linear(q8, scale, x[r : r + 1], library), got[r : r + 1]
            )


@pytest.mark.parametrize("num_rows", [1, 3, 8, 13])
@pytest.mark.parametrize("bias", [False, True])
def test_products_match_their_references(num_rows, bias):
    """int4 and int8 products (rows four at a time and alone) as their torch references
    compute them, to float32 rounding (the same quantised activations, integer dots), and
    each row's result the same bits as when it is multiplied alone."""
    torch.manual_seed(num_rows)
    weight = torch.randn(80, 320) * 0.05  # 10 groups of 32: a block of 8 and a tail
    x = torch.randn(num_rows, 320)
    q4 = Q4Weight(weight, torch.randn(80) if bias else None)
    got = cpu_native_decode.q4_linear(q4, x)
    torch.testing.assert_close(
        got, cpu_native_decode.q4_linear_reference(q4, x), atol=2e-5, rtol=1e-5
    )
    # and within the int4 and int8 rounding of the float32 product
    torch.testing.assert_close(
        got, x @ q4.dequantised().T + (0 if q4.bias is None else q4.bias), atol=0.05, rtol=0
    )
    for r in range(num_rows):  # batch-invariant: each row alone, bit for bit
        assert torch.equal(cpu_native_decode.q4_linear(q4, x[r : r + 1]), got[r : r + 1])
    q8, scale, _ = cpu_quant.quantize_int8(weight)
    scale = scale.float()
    got = cpu_native_decode.q8_linear(q8, scale, x)
    want = cpu_native_decode.q8_linear_reference(q8, scale, x)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    for r in range(num_rows):
        assert torch.equal(cpu_native_decode.q8_linear(q8, scale, x[r : r + 1]), got[r : r + 1])


@pytest.mark.parametrize("kind", ["llama", "llama_tied", "qwen3", "qwen2"])
def test_native_step_matches_its_torch_reference(tmp_path, kind):
    """Requests join and leave (batch 1..3), sequences cross block boundaries, tables are
    scattered: each step, from the same cache, gives the reference's logits, hidden
    states and K/V writes, within what a rounding flip does: the kernel and the reference sum in other orders,
    so an activation a hair from a quantisation boundary can round to its neighbour
    (one int8 step of one group), which moves outputs by ~1e-3 (exact products:
    ``test_products_match_their_references``)."""
    overrides = {"use_sliding_window": False} if kind == "qwen2" else {}
    make_hf_model(kind, tmp_path, **overrides)
    runner = _runner(tmp_path)
    native = cpu_native_decode.try_native_decode(
        runner.model, runner.kv_caches, BLOCK_SIZE, is_gpu=False
    )
    assert native is not None
    reference_caches = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    rng = np.random.default_rng(0)
    tables = rng.permutation(NUM_BLOCKS)[: 3 * 8].reshape(3, 8)  # 8 blocks per request
    lengths = [0, 0, 0]
    for step in range(14):
        live = [r for r in range(3) if step >= 3 * r and lengths[r] < 30]
        ids = rng.integers(0, 512, len(live))
        positions = np.array([lengths[r] for r in live])
        seq_lens = positions + 1
        width = int(seq_lens.max() + BLOCK_SIZE - 1) // BLOCK_SIZE
        block_tables = tables[live][:, :width]
        slots = np.array(
            [
                tables[r][lengths[r] // BLOCK_SIZE] * BLOCK_SIZE + lengths[r] % BLOCK_SIZE
                for r in live
            ]
        )
        for (k, v), (ref_k, ref_v) in zip(runner.kv_caches, reference_caches, strict=True):
            ref_k.copy_(k), ref_v.copy_(v)  # each step from the same cache (no drift)
        logits, hidden = native(ids, positions, seq_lens, block_tables, slots)
        want_logits, want_hidden = reference_step(
            native, reference_caches, *map(torch.from_numpy, (ids, positions, seq_lens)),
            torch.from_numpy(block_tables), torch.from_numpy(slots),
        )  # fmt: skip
        torch.testing.assert_close(hidden, want_hidden, atol=0.1, rtol=0)
        torch.testing.assert_close(logits, want_logits, atol=0.05, rtol=0)
        assert (logits - want_logits).abs().mean() < 5e-3
        for r in live:
            lengths[r] += 1
    for (k, v), (want_k, want_v) in zip(runner.kv_caches, reference_caches, strict=True):
        torch.testing.assert_close(k, want_k, atol=0.02, rtol=0)
        torch.testing.assert_close(v, want_v, atol=0.02, rtol=0)


def test_logits_do_not_depend_on_the_batch(tmp_path):
    """Requests alone and among ten (a tile of 8 rows and two rows on their own): bit for
    bit the same logits (each output is reduced in a fixed order, the same in a tile)."""
    make_hf_model("llama", tmp_path)
    runner = _runner(tmp_path)
    native = NativeDecode(runner.model, runner.kv_caches, BLOCK_SIZE)
    tables = np.arange(30).reshape(10, 3)
    slots = tables[:, 0] * BLOCK_SIZE
    ones = np.ones(10, dtype=np.int64)
    batched, _ = native(np.arange(10, 20), ones - 1, ones, tables, slots)
    for r in (0, 7, 9):
        alone, _ = native(
            np.array([10 + r]), ones[:1] - 1, ones[:1], tables[r : r + 1], slots[r : r + 1]
        )
        assert torch.equal(batched[r : r + 1], alone)


def test_out_of_range_ids_are_refused(tmp_path):
    make_hf_model("llama", tmp_path)
    runner = _runner(tmp_path)
    native = NativeDecode(runner.model, runner.kv_caches, BLOCK_SIZE)
    one = np.ones(1, dtype=np.int64)
    refused = "token id, position or logit row out of range"
    with pytest.raises(ValueError, match=refused):
        native(np.array([512]), one - 1, one, np.zeros((1, 2)), one - 1)
    with pytest.raises(ValueError, match=refused):
        native(np.array([5]), one * 10_000, one, np.zeros((1, 2)), one - 1)
    with pytest.raises(ValueError, match=refused):
        native(np.array([5]), one - 1, one, np.zeros((1, 2)), one - 1, one)  # row 1 of 1


def _greedy(runner: ModelRunner, prompts: dict[str, list[int]], steps: int) -> EngineSim:
    engine = EngineSim(runner.execute, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    params = SamplingParams(temperature=0.0, logprobs=3)
    engine.logprobs = {request_id: [] for request_id in prompts}
    for request_id, prompt in prompts.items():
        engine.add(request_id, prompt, params)
        engine.step({request_id: len(prompt)})
    for _ in range(steps):
        output = engine.step({request_id: 1 for request_id in engine.requests})
        for request_id, top in zip(output.request_ids, output.top_logprobs, strict=True):
            engine.logprobs[request_id].append(top)
    return engine


def _count_native_calls(runner: ModelRunner, monkeypatch) -> list[int]:
    """The batch size of each native step ``runner`` takes from now on."""
    calls: list[int] = []
    native_call = runner.cpu_steps.native_decode.__call__
    monkeypatch.setattr(
        runner.cpu_steps.native_decode.__class__, "__call__",
        lambda self, *args: calls.append(len(args[0])) or native_call(*args),
    )  # fmt: skip
    return calls


def test_the_runner_decodes_through_it_as_through_the_int4_path(tmp_path, monkeypatch):
    """Prompts prefill on the dense weights (no short native chunks here), decodes go
    native (counted): greedy tokens as the torch int4 path's, top log-probabilities
    within its bf16 activation rounding."""
    monkeypatch.setattr(cpu_steps, "NATIVE_PROMPT_TOKENS", 0)
    make_hf_model("llama", tmp_path)
    prompts = {"a": [5, 6, 7], "b": [9, 10, 11, 12, 13, 14], "c": [3] * 11}
    torch_path = _greedy(_runner(tmp_path), prompts, steps=8)
    runner = _runner(tmp_path)
    assert runner.use_native_decode()
    calls = _count_native_calls(runner, monkeypatch)
    native_path = _greedy(runner, prompts, steps=8)
    assert calls == [3] * 8  # the decode steps only, prompts elsewhere
    for request_id in prompts:
        assert (
            native_path.requests[request_id].token_ids == torch_path.requests[request_id].token_ids
        )
        for ours, theirs in zip(
            native_path.logprobs[request_id], torch_path.logprobs[request_id], strict=True
        ):
            torch.testing.assert_close(
                torch.tensor([lp for _, lp in ours]), torch.tensor([lp for _, lp in theirs]),
                atol=0.02, rtol=0,
            )  # fmt: skip


def test_batches_above_its_rows_go_elsewhere(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_native_decode, "MAX_NATIVE_ROWS", 1)
    monkeypatch.setattr("vtllm.worker.cpu_steps.MAX_NATIVE_ROWS", 1)
    make_hf_model("llama", tmp_path)
    runner = _runner(tmp_path)
    assert runner.use_native_decode()
    calls = _count_native_calls(runner, monkeypatch)
    _greedy(runner, {"a": [5, 6], "b": [7, 8]}, steps=2)
    assert calls == [2, 2]  # the two short prompts, one row a token; no decode of 2 rows


def test_where_it_does_not_apply(tmp_path, monkeypatch):
    make_hf_model("llama", tmp_path / "llama")
    assert not _runner(tmp_path / "llama", "none").use_native_decode()  # float32 linears
    assert not _runner(tmp_path / "llama", "int8").use_native_decode()
    make_hf_model("mistral", tmp_path / "mistral")
    assert not _runner(tmp_path / "mistral").use_native_decode()  # sliding windows
    monkeypatch.setenv("VT_CPU_NATIVE_DECODE", "off")
    assert not _runner(tmp_path / "llama").use_native_decode()


def test_embedded_model_answers_the_readme_question_as_float32(smollm2_dir):
    """`make serve`'s decode path on the embedded SmolLM2: the README's question gets the
    same 16 greedy tokens as the float32 model."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    prompt = readme_prompt(tokenizer)

    def generate(quantization: str) -> list[int]:
        runner = ModelRunner.from_model_dir(
            smollm2_dir, torch.device("cpu"), torch.float32, seed=0,
            cpu_quantization=quantization,
        )  # fmt: skip
        runner.init_kv_cache(num_blocks=16, block_size=16)
        assert runner.use_native_decode() == (quantization == "int4")
        return greedy_tokens(runner, prompt, 16)

    native = generate("int4")
    assert native == generate("none")
    assert tokenizer.decode(native).startswith("The capital of France is Paris")


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch-int4"])
def test_a_decode_beside_a_prompt_is_computed_as_alone(tmp_path, monkeypatch, native):
    """A step that prefills one request and decodes another decodes it exactly as a
    decode-only step would (quantised weights; the prompt on the dense ones): before, the
    whole step read the dense weights, so a seeded request's output changed with what
    shared its first decode."""
    make_hf_model("llama", tmp_path)
    params = SamplingParams(temperature=0.0, logprobs=3)
    decoded = []
    for beside_a_prompt in (False, True):
        runner = _runner(tmp_path)
        if native:
            assert runner.use_native_decode()
        engine = EngineSim(runner.execute, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
        engine.add("a", [5, 6, 7], params)
        engine.step({"a": 3})
        if native:
            calls = _count_native_calls(runner, monkeypatch)
        schedule = {"a": 1}
        if beside_a_prompt:
            engine.add("b", [9, 10, 11, 12, 13], params)
            schedule["b"] = 5
        output = engine.step(schedule)
        assert output.request_ids[0] == "a" and len(output.request_ids) == len(schedule)
        decoded.append(output.top_logprobs[0])
        if native:  # b's short prompt runs beside a's decode, one row a token
            assert calls == ([1 + 5] if beside_a_prompt else [1])
            monkeypatch.undo()
    assert decoded[0] == decoded[1]


def test_prompt_rows_match_the_reference_and_give_the_logits_asked_for(tmp_path):
    """A prompt chunk of 6 tokens (rows sharing their table, each attending up to its own
    position) beside a decode of another request: the reference's logits, hidden states
    and K/V within rounding flips; logits of the rows asked for only, bit for bit those
    of all rows."""
    make_hf_model("qwen3", tmp_path)
    runner = _runner(tmp_path)
    native = NativeDecode(runner.model, runner.kv_caches, BLOCK_SIZE)
    for k, v in runner.kv_caches:
        k.normal_(), v.normal_()  # request 1 has 9 keys before this step
    reference_caches = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    tables = np.array([[4, 9, 2, 0], [7, 1, 3, 0]])
    positions = np.array([0, 1, 2, 3, 4, 5, 9])  # request 0: its prompt; 1: a decode
    rows = np.array([0] * 6 + [1])
    slots = tables[rows, positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
    ids = np.array([11, 12, 13, 14, 15, 16, 40])
    logits, hidden = native(ids, positions, positions + 1, tables[rows], slots)
    want_logits, want_hidden = reference_step(
        native, reference_caches, *map(torch.from_numpy, (ids, positions, positions + 1)),
        torch.from_numpy(tables[rows]), torch.from_numpy(slots),
    )  # fmt: skip
    torch.testing.assert_close(hidden, want_hidden, atol=0.1, rtol=0)
    torch.testing.assert_close(logits, want_logits, atol=0.05, rtol=0)
    for (k, v), (want_k, want_v) in zip(runner.kv_caches, reference_caches, strict=True):
        torch.testing.assert_close(k, want_k, atol=0.02, rtol=0)
        torch.testing.assert_close(v, want_v, atol=0.02, rtol=0)
    some, _ = native(ids, positions, positions + 1, tables[rows], slots, np.array([6, 5]))
    assert torch.equal(some, logits[[6, 5]])


def _prefill_then_decode(runner: ModelRunner, prompt: list[int], chunk: int) -> EngineSim:
    engine = EngineSim(runner.execute, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    engine.add("a", prompt, SamplingParams(temperature=0.0, logprobs=3))
    engine.logprobs = {"a": []}
    for start in range(0, len(prompt), chunk):
        output = engine.step({"a": min(chunk, len(prompt) - start)})
    for _ in range(4):
        engine.logprobs["a"].append(output.top_logprobs[0])
        output = engine.step({"a": 1})
    return engine


def test_a_short_chunk_is_computed_as_its_tokens_decoded_one_by_one(tmp_path, monkeypatch):
    """Each row of the native step is computed alone, so a 9-token prompt prefilled in one
    native step, in chunks of 4, or a token a step gives bit for bit the same log-probs
    and tokens; all of it native (counted)."""
    make_hf_model("llama", tmp_path)
    prompt = [5, 17, 9, 300, 41, 7, 7, 2, 88]
    results = []
    for chunk in (9, 4, 1):
        runner = _runner(tmp_path)
        assert runner.use_native_decode()
        calls = _count_native_calls(runner, monkeypatch)
        engine = _prefill_then_decode(runner, prompt, chunk)
        assert calls == [min(chunk, 9 - s) for s in range(0, 9, chunk)] + [1] * 4
        monkeypatch.undo()
        results.append((engine.requests["a"].token_ids, engine.logprobs["a"]))
    assert results[0] == results[1] == results[2]


def test_long_chunks_and_long_contexts_prefill_on_the_dense_weights(tmp_path, monkeypatch):
    """Chunks over NATIVE_PROMPT_TOKENS, or whose tokens x keys pass NATIVE_PROMPT_WORK,
    and steps whose native rows would pass MAX_NATIVE_TOKENS, take the dense prompt path;
    a step with a short and a long chunk runs the short one native."""
    monkeypatch.setattr(cpu_steps, "NATIVE_PROMPT_TOKENS", 4)
    make_hf_model("llama", tmp_path)
    runner = _runner(tmp_path)
    assert runner.use_native_decode()
    calls = _count_native_calls(runner, monkeypatch)
    engine = EngineSim(runner.execute, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    params = SamplingParams(temperature=0.0)
    engine.add("long", list(range(10, 16)), params)
    engine.add("short", [3, 4, 5], params)
    engine.step({"long": 6, "short": 3})
    assert calls == [3]  # the long chunk (6 > 4 tokens) on the dense weights
    monkeypatch.setattr(cpu_steps, "NATIVE_PROMPT_WORK", 3 * 3 - 1)
    engine.add("wide", [6, 7, 8], params)
    engine.step({"wide": 3})
    assert calls == [3]  # 3 tokens x 3 keys > 8
    monkeypatch.setattr(cpu_steps, "NATIVE_PROMPT_WORK", 1 << 20)
    monkeypatch.setattr(cpu_steps, "MAX_NATIVE_TOKENS", 2)
    engine.add("many", [1, 2, 3], params)
    engine.step({"many": 3, "long": 1})
    assert calls == [3, 1]  # only the decode: 1 + 3 rows > 2
