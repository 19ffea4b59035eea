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
    """bf16, a 1100-token prompt (past the 1024 window) beside a 7-token one, then 12
    decode steps of both; worst logprob difference and greedy agreement printed. Random
    weights route nearly uniformly, so bf16 noise can swap an expert at the top-8
    boundary: most outputs must agree within 0.25, as for the other MoE families."""
    import json

    device = detect_platform(0).device
    config = _two_layer_26b_config()
    (tmp_path / "config.json").write_text(json.dumps(config))
    runner = ModelRunner.from_model_dir(
        tmp_path, device, torch.bfloat16, seed=0, load_format="dummy"
    )
    reference = _reference(config, runner, tmp_path)
    runner.init_kv_cache(num_blocks=160, block_size=16)
    engine = EngineSim(runner.execute, num_blocks=160, block_size=16)
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, logprobs=20)
    engine.add("a", [rng.randrange(10, 200000) for _ in range(1100)], params)
    engine.add("b", [rng.randrange(10, 200000) for _ in range(7)], params)
    schedule = {"a": 1100, "b": 7}
    worst, same_pick, close, total = 0.0, 0, 0, 0
    for _ in range(13):
        output = engine.step(schedule)
        for i, request_id in enumerate(output.request_ids):
            expected = reference(engine.requests[request_id].token_ids[:-1])  # [vocab]
            ids = [token_id for token_id, _ in output.top_logprobs[i]]
            actual = torch.tensor([logprob for _, logprob in output.top_logprobs[i]])
            difference = float((actual - expected[ids]).abs().max())
            worst = max(worst, difference)
            close += difference <= 0.25
            same_pick += output.sampled_token_ids[i] == int(expected.argmax())
            total += 1
        schedule = {"a": 1, "b": 1}
        if total >= 8 and reference.slow:  # the CPU reference: fewer steps
            break
    print(
        f"gemma4-26b (2 layers) bf16 vs {reference.name}: max |dlogprob| {worst:.4f}, "
        f"{close}/{total} within 0.25, {same_pick}/{total} same pick"
    )
    assert close >= 0.85 * total and same_pick >= 0.85 * total


class _Reference:
    """Last-position log-softmax of a token sequence, ``[vocab]`` float32 on the CPU."""

    def __init__(self, name: str, fn, slow: bool) -> None:
        self.name, self.fn, self.slow = name, fn, slow

    def __call__(self, token_ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return self.fn(token_ids)


def _reference(config: dict, runner: ModelRunner, tmp_path) -> _Reference:
    """transformers in bf16 on the GPU holding the runner's weights when it has Gemma 4,
    else vtllm's torch path in fp32 on the CPU with the same weights."""
    device = runner.device
    if _has_gemma4():
        import transformers

        settings = {k: v for k, v in config.items() if k not in ("architectures", "model_type")}
        hf_config = transformers.Gemma4TextConfig(**settings)
        with torch.device(device):
            hf_model = transformers.Gemma4ForCausalLM(hf_config).to(torch.bfloat16).eval()
        _copy_weights_to_transformers(runner.model, hf_model)

        def run(token_ids: list[int]) -> torch.Tensor:
            logits = hf_model(torch.tensor([token_ids], device=device)).logits[0, -1]
            return torch.log_softmax(logits.float(), dim=-1).cpu()

        return _Reference("transformers", run, slow=False)
    cpu_runner = ModelRunner.from_model_dir(
        tmp_path, torch.device("cpu"), torch.float32, seed=0, load_format="dummy"
    )
    with torch.no_grad():
        for target, source in zip(
            cpu_runner.model.parameters(), runner.model.parameters(), strict=True
        ):
            target.copy_(source.float().cpu())
    cpu_runner.init_kv_cache(num_blocks=80, block_size=16)

    def run_cpu(token_ids: list[int]) -> torch.Tensor:
        engine = EngineSim(cpu_runner.execute, num_blocks=80, block_size=16)
        every_logprob = SamplingParams(temperature=0.0, logprobs=config["vocab_size"])
        engine.add("r", token_ids, every_logprob)
        output = engine.step({"r": len(token_ids)})
        engine.finish("r")
        engine.step({})
        return full_logprobs(output, 0, config["vocab_size"])

    return _Reference("vtllm torch fp32 (CPU)", run_cpu, slow=True)


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
