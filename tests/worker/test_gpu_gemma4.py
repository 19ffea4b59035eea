"""GPU runs of Gemma 4 (``-m gpu``): the tiny configs in fp32 through the Triton kernels
(paged attention at head dims 16 and 32, rotary, the Gemma 4 RMSNorm, fused MoE with GeGLU)
against transformers; two layers of the real 26B-A4B shape (one sliding, one full
attention layer with head_dim 512 and shared k/v; 128 experts of 704, top 8; random
weights) in bf16; and decode graphs against eager steps.

transformers is the reference when the machine's copy has Gemma 4 (``Gemma4TextConfig``);
otherwise the tiny tests skip and the realistic one compares against vtllm's torch path
in fp32 on the CPU, which CI holds to transformers 5.24 (``test_gemma4_vs_transformers``).
"""

from __future__ import annotations

import random

import pytest
import torch

from vtllm.bench import MODEL_SHAPES
from vtllm.protocol.messages import SamplingParams
from vtllm.worker.model_runner import ModelRunner
from vtllm.worker.platform import detect_platform

from .tiny_models import VOCAB_SIZE, EngineSim, full_logprobs, hf_last_logprobs, make_hf_model

pytestmark = pytest.mark.gpu


def _has_gemma4() -> bool:
    import transformers

    return hasattr(transformers, "Gemma4TextConfig")


needs_gemma4 = pytest.mark.skipif(
    not _has_gemma4(), reason="this machine's transformers has no Gemma 4 to compare with"
)


@needs_gemma4
@pytest.mark.parametrize("kind", ["gemma4_moe", "gemma4_ple", "gemma4_wrapper"])
def test_tiny_gemma4_fp32_on_gpu_matches_transformers(kind, tmp_path):
    """A 23-token prefill beside a 3-token one, then batch-2 decodes past the 6-token
    window: fp32 kernels vs transformers on the CPU."""
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


def _two_layer_26b_config() -> dict:
    """The released 26B-A4B text config cut to one sliding and one full layer."""
    config = dict(MODEL_SHAPES["gemma4-26b-moe"])
    config["num_hidden_layers"] = 2
    config["layer_types"] = ["sliding_attention", "full_attention"]
    return config


def test_realistic_26b_layers_bf16(tmp_path):
    """bf16, a 1100-token prompt (past the 1024 window) beside a 7-token one, then decode
    steps of both. Random-weight Gemma 4 is noisy in bf16 (attention at scale 1 over
    RMS-normed q and k is sharp; measured on the CPU at a shrunk shape: transformers'
    own bf16 is 0.64 in logprob off its fp32, vtllm's 0.62, the two 0.16 apart), so the
    bar is relative: against an fp32 truth on the same weights, vtllm's bf16 errors may
    be at most 1.5x (+0.05) a bf16 baseline's (transformers' bf16, else vtllm's torch
    path in bf16 on the CPU), and its greedy picks agree with the truth nearly as often."""
    import json

    device = detect_platform(0).device
    config = _two_layer_26b_config()
    (tmp_path / "config.json").write_text(json.dumps(config))
    runner = ModelRunner.from_model_dir(
        tmp_path, device, torch.bfloat16, seed=0, load_format="dummy"
    )
    truth, baseline = _references(config, runner, tmp_path)
    runner.init_kv_cache(num_blocks=160, block_size=16)
    engine = EngineSim(runner.execute, num_blocks=160, block_size=16)
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, logprobs=20)
    engine.add("a", [rng.randrange(10, 200000) for _ in range(1100)], params)
    engine.add("b", [rng.randrange(10, 200000) for _ in range(7)], params)
    schedule = {"a": 1100, "b": 7}
    ours_errors, baseline_errors, ours_same, baseline_same = [], [], 0, 0
    for _ in range(2 if truth.slow else 13):  # the CPU references: prefill and one decode
        output = engine.step(schedule)
        for i, request_id in enumerate(output.request_ids):
            tokens = engine.requests[request_id].token_ids[:-1]
            expected, base = truth(tokens), baseline(tokens)  # [vocab] each
            ids = [token_id for token_id, _ in output.top_logprobs[i]]
            actual = torch.tensor([logprob for _, logprob in output.top_logprobs[i]])
            ours_errors.append(float((actual - expected[ids]).abs().max()))
            baseline_errors.append(float((base[ids] - expected[ids]).abs().max()))
            ours_same += output.sampled_token_ids[i] == int(expected.argmax())
            baseline_same += int(base.argmax()) == int(expected.argmax())
        schedule = {"a": 1, "b": 1}
    count = len(ours_errors)
    mean_ours, mean_base = sum(ours_errors) / count, sum(baseline_errors) / count
    print(
        f"gemma4-26b (2 layers) vs {truth.name} over {count} outputs: vtllm bf16 max "
        f"{max(ours_errors):.4f} mean {mean_ours:.4f}, {ours_same} same picks; "
        f"{baseline.name} max {max(baseline_errors):.4f} mean {mean_base:.4f}, "
        f"{baseline_same} same picks"
    )
    assert max(ours_errors) <= 1.5 * max(baseline_errors) + 0.05
    assert mean_ours <= 1.5 * mean_base + 0.05
    assert ours_same >= baseline_same - max(2, count // 10)


class _Reference:
    """Last-position log-softmax of a token sequence, ``[vocab]`` float32 on the CPU."""

    def __init__(self, name: str, fn, slow: bool) -> None:
        self.name, self.fn, self.slow = name, fn, slow

    def __call__(self, token_ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return self.fn(token_ids)


def _references(config: dict, runner: ModelRunner, tmp_path) -> tuple[_Reference, _Reference]:
    """(fp32 truth, bf16 baseline) holding the runner's weights: transformers on the GPU
    when it has Gemma 4, else vtllm's torch path on the CPU."""
    if _has_gemma4():
        import copy

        import transformers

        settings = {k: v for k, v in config.items() if k not in ("architectures", "model_type")}
        with torch.device(runner.device):
            hf_fp32 = transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(**settings))
        _copy_weights_to_transformers(runner.model, hf_fp32.float().eval())
        hf_bf16 = copy.deepcopy(hf_fp32).to(torch.bfloat16)
        return (
            _Reference("transformers fp32", _hf_logprobs(hf_fp32), slow=False),
            _Reference("transformers bf16", _hf_logprobs(hf_bf16), slow=False),
        )
    return (
        _Reference("vtllm torch fp32 (CPU)", _cpu_logprobs(runner, tmp_path, torch.float32), True),
        _Reference("vtllm torch bf16 (CPU)", _cpu_logprobs(runner, tmp_path, torch.bfloat16), True),
    )


def _hf_logprobs(hf_model):
    device = next(hf_model.parameters()).device

    def run(token_ids: list[int]) -> torch.Tensor:
        logits = hf_model(torch.tensor([token_ids], device=device)).logits[0, -1]
        return torch.log_softmax(logits.float(), dim=-1).cpu()

    return run


def _cpu_logprobs(runner: ModelRunner, tmp_path, dtype: torch.dtype):
    """vtllm's torch path on the CPU in ``dtype`` with ``runner``'s weights: one fresh
    prefill per call."""
    cpu_runner = ModelRunner.from_model_dir(
        tmp_path, torch.device("cpu"), dtype, seed=0, load_format="dummy"
    )
    with torch.no_grad():
        for target, source in zip(
            cpu_runner.model.parameters(), runner.model.parameters(), strict=True
        ):
            target.copy_(source.to("cpu", dtype))
    cpu_runner.init_kv_cache(num_blocks=80, block_size=16)
    vocab_size = cpu_runner.vocab_size

    def run(token_ids: list[int]) -> torch.Tensor:
        engine = EngineSim(cpu_runner.execute, num_blocks=80, block_size=16)
        engine.add("r", token_ids, SamplingParams(temperature=0.0, logprobs=vocab_size))
        output = engine.step({"r": len(token_ids)})
        engine.finish("r")
        engine.step({})
        return full_logprobs(output, 0, vocab_size)

    return run


def _copy_weights_to_transformers(model, hf_model) -> None:
    """The runner's (dummy) weights into transformers' module layout."""
    hf_layers = hf_model.model.layers
    with torch.no_grad():
        hf_model.model.embed_tokens.weight.copy_(model.model.embed_tokens.weight)
        hf_model.model.norm.weight.copy_(model.model.norm.weight)
        for layer, hf_layer in zip(model.model.layers, hf_layers, strict=True):
            attn, hf_attn = layer.self_attn, hf_layer.self_attn
            q_size = attn.num_heads * attn.head_dim
            kv_size = attn.num_kv_heads * attn.head_dim
            qkv = attn.qkv_proj.weight
            hf_attn.q_proj.weight.copy_(qkv[:q_size])
            hf_attn.k_proj.weight.copy_(qkv[q_size : q_size + kv_size])
            if hf_attn.v_proj is not None:
                hf_attn.v_proj.weight.copy_(qkv[q_size + kv_size :])
            for name in ("q_norm", "k_norm", "o_proj"):
                getattr(hf_attn, name).weight.copy_(getattr(attn, name).weight)
            inter = layer.mlp.down_proj.weight.shape[1]
            hf_layer.mlp.gate_proj.weight.copy_(layer.mlp.gate_up_proj.weight[:inter])
            hf_layer.mlp.up_proj.weight.copy_(layer.mlp.gate_up_proj.weight[inter:])
            hf_layer.mlp.down_proj.weight.copy_(layer.mlp.down_proj.weight)
            for name in (
                "input_layernorm",
                "post_attention_layernorm",
                "pre_feedforward_layernorm",
                "post_feedforward_layernorm",
                "post_feedforward_layernorm_1",
                "pre_feedforward_layernorm_2",
                "post_feedforward_layernorm_2",
            ):
                getattr(hf_layer, name).weight.copy_(getattr(layer, name).weight)
            hf_layer.router.proj.weight.copy_(layer.router.proj.weight)
            hf_layer.router.scale.copy_(layer.router.scale)
            hf_layer.router.per_expert_scale.copy_(layer.router.per_expert_scale)
            hf_layer.experts.gate_up_proj.copy_(layer.experts.w13_weight)
            hf_layer.experts.down_proj.copy_(layer.experts.w2_weight)
            hf_layer.layer_scalar.copy_(layer.layer_scalar)


@needs_gemma4
@pytest.mark.parametrize("kind", ["gemma4_moe", "gemma4_ple"])
def test_decode_graphs_with_gemma4_match_eager_steps(kind, tmp_path):
    """Real graphs (per-layer KV shapes, KV-sharing layers, experts) against eager steps,
    fp32."""
    from .test_decode_graphs import assert_same_outputs, run_scenario

    make_hf_model(kind, tmp_path)
    platform = detect_platform(0)
    _, eager = run_scenario(tmp_path, False, 64, platform)
    runner, graphed = run_scenario(tmp_path, True, 64, platform)
    assert runner.decode_graphs is not None and runner.decode_graphs.use_graphs
    assert_same_outputs(eager, graphed, atol=1e-4)
