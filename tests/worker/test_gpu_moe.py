"""GPU runs of the MoE models (``-m gpu``): the tiny Qwen3-MoE / Mixtral in fp32 through the
Triton fused-MoE kernels (decode GEMV and prefill grouped GEMM) against transformers, and
realistic layer shapes (Qwen3-30B-A3B, Mixtral-8x7B; a few layers, random weights) in bf16."""

from __future__ import annotations

import random

import pytest
import torch

from vtllm.protocol.messages import SamplingParams
from vtllm.worker.model_runner import ModelRunner
from vtllm.worker.platform import detect_platform

from .tiny_models import VOCAB_SIZE, EngineSim, full_logprobs, hf_last_logprobs, make_hf_model

pytestmark = pytest.mark.gpu

# the released configs' layer dimensions (Qwen/Qwen3-30B-A3B, mistralai/Mixtral-8x7B-v0.1)
REALISTIC = {
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        rope_theta=1e6,
        num_hidden_layers=4,
    ),
    "mixtral-8x7b": dict(
        model_type="mixtral",
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_attention_heads=32,
        num_key_value_heads=8,
        num_local_experts=8,
        num_experts_per_tok=2,
        rope_theta=1e6,
        num_hidden_layers=2,
    ),
}


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_tiny_moe_fp32_on_gpu_matches_transformers(kind, tmp_path):
    """Batch 2 decode (4 pairs <= 8 / 4 experts: GEMV path) and a 23-token prefill
    (grouped GEMM path), fp32 kernels vs transformers on CPU."""
    hf_model = make_hf_model(kind, tmp_path)
    device = detect_platform(0).device
    runner = ModelRunner.from_model_dir(tmp_path, device, torch.float32, seed=0)
    runner.init_kv_cache(num_blocks=64, block_size=16)
    engine = EngineSim(runner.execute, num_blocks=64, block_size=16)
    params = SamplingParams(temperature=0.0, logprobs=VOCAB_SIZE)
    engine.add("a", list(range(3, 26)), params)
    engine.add("b", [5, 6, 7], params)
    schedule = {"a": 23, "b": 3}
    for _ in range(12):
        output = engine.step(schedule)
        for i, request_id in enumerate(output.request_ids):
            expected = hf_last_logprobs(hf_model, engine.requests[request_id].token_ids[:-1])
            torch.testing.assert_close(
                full_logprobs(output, i, VOCAB_SIZE), expected, atol=1e-3, rtol=0
            )
            assert output.sampled_token_ids[i] == int(expected.argmax())
        schedule = {"a": 1, "b": 1}


@pytest.mark.parametrize("shape", sorted(REALISTIC))
def test_realistic_moe_bf16_matches_transformers(shape, tmp_path):
    """bf16 on both sides, prefill of 100 + 7 tokens then 16 decode steps of both. Random
    weights route nearly uniformly, so bf16 noise can swap an expert at the top-k
    boundary between the two implementations: the tolerance is looser than the dense
    test's (0.12); the worst difference and the greedy agreement are printed."""
    import transformers

    settings = dict(REALISTIC[shape])
    config = transformers.AutoConfig.for_model(settings.pop("model_type"), **settings)
    device = detect_platform(0).device
    torch.manual_seed(0)
    with torch.device(device):
        hf_model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    hf_model.eval().save_pretrained(tmp_path, safe_serialization=True)
    runner = ModelRunner.from_model_dir(tmp_path, device, torch.bfloat16, seed=0)
    runner.init_kv_cache(num_blocks=256, block_size=16)
    engine = EngineSim(runner.execute, num_blocks=256, block_size=16)
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, logprobs=20)
    engine.add("a", [rng.randrange(10, 1000) for _ in range(100)], params)
    engine.add("b", [rng.randrange(10, 1000) for _ in range(7)], params)
    schedule = {"a": 100, "b": 7}
    worst, same_pick, close = 0.0, 0, 0
    with torch.inference_mode():
        for _ in range(17):
            output = engine.step(schedule)
            for i, request_id in enumerate(output.request_ids):
                tokens = engine.requests[request_id].token_ids[:-1]
                logits = hf_model(torch.tensor([tokens], device=device)).logits[0, -1]
                expected = torch.log_softmax(logits.float(), dim=-1).cpu()
                ids = [token_id for token_id, _ in output.top_logprobs[i]]
                actual = torch.tensor([logprob for _, logprob in output.top_logprobs[i]])
                difference = float((actual - expected[ids]).abs().max())
                worst = max(worst, difference)
                close += difference <= 0.25
                chosen = output.sampled_token_ids[i]
                same_pick += chosen == int(expected.argmax())
            schedule = {"a": 1, "b": 1}
    print(
        f"{shape} bf16 vs transformers: max |dlogprob| {worst:.4f}, {close}/34 outputs within "
        f"0.25, {same_pick}/34 same pick"
    )
    # Mixtral routes each token to 2 of 8 experts with weights near 1/2: a near-tie at the
    # top-2 boundary, flipped by bf16 rounding (measured on the H200: outputs off by up
    # to 3.0 in 2 of 34 outputs while the MoE layers agree to 0.06 at output scale 1.5, see the layer test
    # below), changes half of that layer's output. The layer test holds the kernels to
    # bf16 noise; here most outputs must agree.
    assert close >= 30 and same_pick >= 30


@pytest.mark.parametrize("tokens", [1, 2, 107, 214])
def test_mixtral_8x7b_moe_layer_bf16_matches_transformers(tokens):
    """One Mixtral-8x7B MoE block (hidden 4096, 8 experts of width 14336, top-2) in bf16:
    transformers' own block against select_experts + fused_moe on both kernel paths and
    the torch reference, on the same weights and inputs (no upstream noise, so no
    routing flips)."""
    import transformers
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    from vtllm.worker.kernels.fused_moe import fused_moe, fused_moe_ref
    from vtllm.worker.layers.moe import RouterSpec, select_experts

    config = transformers.MixtralConfig(
        hidden_size=4096, intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2
    )
    device = detect_platform(0).device
    torch.manual_seed(0)
    block = MixtralSparseMoeBlock(config).to(device, torch.bfloat16)
    for parameter in block.parameters():
        torch.nn.init.normal_(parameter, std=0.02)
    x = torch.randn(tokens, config.hidden_size, device=device, dtype=torch.bfloat16)
    with torch.inference_mode():
        expected = block(x[None])
        expected = (expected[0] if isinstance(expected, tuple) else expected)[0].float()
        weights, ids = select_experts(
            torch.nn.functional.linear(x, block.gate.weight), RouterSpec(top_k=2)
        )
        w13, w2 = block.experts.gate_up_proj, block.experts.down_proj
        reference = fused_moe_ref(x, w13, w2, weights, ids).float()
        scale = float(expected.abs().mean())  # ~1.5
        assert float((reference - expected).abs().max()) < 0.1 * scale
        for path in ("gemv", "gemm"):
            actual = fused_moe(x, w13, w2, weights, ids, path=path).float()
            assert float((actual - reference).abs().max()) < 0.1 * scale, path


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_decode_graphs_with_moe_match_eager_steps(kind, tmp_path):
    """Real graphs (captured at 1, 2, 4, 6: 2 to 12 pairs over 8 / 4 experts, so both the
    GEMV and the grouped-GEMM path are captured) against eager steps, fp32."""
    from .test_decode_graphs import assert_same_outputs, run_scenario

    make_hf_model(kind, tmp_path)
    platform = detect_platform(0)
    _, eager = run_scenario(tmp_path, False, 64, platform)
    runner, graphed = run_scenario(tmp_path, True, 64, platform)
    graphs = runner.decode_graphs
    assert graphs is not None and graphs.use_graphs and graphs.sizes == [1, 2, 4, 6]
    assert_same_outputs(eager, graphed, atol=1e-4)


def test_decode_chain_matches_layer_by_layer_steps(tmp_path):
    """Qwen3-30B-A3B layers (4, random bf16 weights): decode steps of two requests through
    the MoE decode chain (the input norm folded into the experts' last kernel and the q/k
    prep, ``models/moe_llama.py``) against the same steps layer by layer, one runner with
    the chain turned off. The chain finishes the norm after the projection, so the two
    differ by bf16 rounding only: the same picks and log-probs within 0.05 while the
    sequences agree."""
    import transformers

    settings = dict(REALISTIC["qwen3-30b-a3b"])
    config = transformers.AutoConfig.for_model(settings.pop("model_type"), **settings)
    device = detect_platform(0).device
    torch.manual_seed(0)
    with torch.device(device):
        hf_model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    hf_model.save_pretrained(tmp_path, safe_serialization=True)
    del hf_model
    rng = random.Random(0)
    prompts = {"a": [rng.randrange(10, 1000) for _ in range(40)], "b": [3, 4, 5, 6, 7]}
    outputs = {}
    for chained in (True, False):
        runner = ModelRunner.from_model_dir(tmp_path, device, torch.bfloat16, seed=0)
        if not chained:
            runner.model._chain_decided, runner.model._chain_why_not = True, "this test"
        runner.init_kv_cache(num_blocks=64, block_size=16)
        engine = EngineSim(runner.execute, num_blocks=64, block_size=16)
        params = SamplingParams(temperature=0.0, logprobs=20)
        for request_id, prompt in prompts.items():
            engine.add(request_id, prompt, params)
        schedule, steps = {"a": 40, "b": 5}, []
        with torch.inference_mode():
            for _ in range(9):
                steps.append(engine.step(schedule))
                schedule = {"a": 1, "b": 1}
        assert runner.model._chain_why_not == (None if chained else "this test")
        outputs[chained] = steps
        del runner, engine
    worst, compared, diverged = 0.0, 0, set()
    for chained, plain in zip(outputs[True], outputs[False], strict=True):
        for i, request_id in enumerate(plain.request_ids):
            if request_id in diverged:  # different contexts from here on
                continue
            expected = dict(plain.top_logprobs[i])
            for token_id, logprob in chained.top_logprobs[i][:5]:
                if token_id in expected:
                    worst = max(worst, abs(logprob - expected[token_id]))
            pick, plain_pick = chained.sampled_token_ids[i], plain.sampled_token_ids[i]
            if pick != plain_pick:  # only a near-tie may flip (random weights: flat logits)
                assert expected[plain_pick] - expected.get(pick, -1e9) < 0.05
                diverged.add(request_id)
            compared += 1
    print(
        f"decode chain vs layer by layer: max |dlogprob| {worst:.4f} over the top 5 of "
        f"{compared} outputs; diverged: {sorted(diverged)}"
    )
    assert worst < 0.05 and compared >= 10
