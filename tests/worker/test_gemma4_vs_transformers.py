"""Gemma 4 text (dense, MoE, per-layer inputs with KV sharing, the multimodal wrapper)
through the model runner against transformers 5.24, and the config refusals.

Tolerance as for the other families (``test_llama_vs_transformers.py``): fp32, full-vocab
logprobs within atol 1e-4 and identical greedy tokens, over a two-request prefill and 16
decode steps, and over a chunked prefill mixed with decodes. The sequences grow past the
6-token sliding window.
"""

from __future__ import annotations

import pytest
import torch

from vtllm.bench import MODEL_SHAPES
from vtllm.protocol.messages import ModelRunnerOutput, SamplingParams
from vtllm.worker.distributed import TPGroup
from vtllm.worker.loader.hf_config import model_facts, text_part
from vtllm.worker.model_runner import ModelRunner
from vtllm.worker.models import build_model
from vtllm.worker.models.gemma4 import Gemma4Args

from .test_llama_vs_transformers import GREEDY_ALL_LOGPROBS, _check, _prefill_then_decode, _runner
from .tiny_models import VOCAB_SIZE, EngineSim, full_logprobs, make_hf_model


@pytest.mark.parametrize("kind", ["gemma4_moe", "gemma4_dense", "gemma4_ple", "gemma4_wrapper"])
def test_prefill_whole_then_decode_two_requests(kind, tmp_path):
    _prefill_then_decode(tmp_path, make_hf_model(kind, tmp_path))


@pytest.mark.parametrize("kind", ["gemma4_moe", "gemma4_ple"])
def test_chunked_prefill_mixed_with_decode(kind, tmp_path):
    """Request a prefills in chunks of 5 while b decodes in the same steps: sliding layers
    reach back into the cached prefix, KV-sharing layers read the chunk their source layer
    wrote earlier in the same step."""
    hf_model = make_hf_model(kind, tmp_path)
    engine = EngineSim(_runner(tmp_path).execute, num_blocks=64, block_size=4, seed=1)
    engine.add("b", [7, 8, 9], GREEDY_ALL_LOGPROBS)
    _check(engine, hf_model, engine.step({"b": 3}))
    engine.add("a", list(range(10, 33)), GREEDY_ALL_LOGPROBS)  # chunks 5, 5, 5, 5, 3
    for chunk in [5, 5, 5, 5, 3]:
        _check(engine, hf_model, engine.step({"a": chunk, "b": 1}))
    for _ in range(8):
        _check(engine, hf_model, engine.step({"b": 1, "a": 1}))


def test_tensor_parallel_two_ranks(tmp_path):
    """Two gloo ranks on the CPU: attention heads, the dense MLP and every expert's width
    split, the router and per-layer scales replicated; prefill and teacher-forced decodes
    against transformers."""
    import socket

    import torch.multiprocessing as mp

    from .moe_tp_rank import run_rank
    from .test_llama_vs_transformers import ATOL
    from .tiny_models import hf_last_logprobs

    hf_model = make_hf_model("gemma4_moe_tp2", tmp_path / "model")
    prompt, forced = [5, 9, 17, 33, 65, 1, 7], [100, 4, 250, 8]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out_path = str(tmp_path / "logprobs.pt")
    args = (2, port, str(tmp_path / "model"), prompt, forced, VOCAB_SIZE, out_path)
    mp.start_processes(run_rank, args=args, nprocs=2, start_method="spawn", join=True)
    actual = torch.load(out_path)  # [len(forced) + 1, vocab]
    for i in range(len(forced) + 1):
        expected = hf_last_logprobs(hf_model, prompt + forced[:i])
        torch.testing.assert_close(actual[i], expected, atol=ATOL, rtol=0)


def test_padded_decode_path_matches_eager_steps(tmp_path):
    """The decode-graph path (padded batches, its eager form on the CPU) with per-layer KV
    shapes and KV-sharing layers gives the eager steps' outputs."""
    from .test_decode_graphs import assert_same_outputs, run_scenario

    make_hf_model("gemma4_ple", tmp_path)
    _, eager = run_scenario(tmp_path, False)
    _, padded = run_scenario(tmp_path, True)
    assert_same_outputs(eager, padded, atol=1e-5)


def test_kv_cache_per_layer_shapes_and_sharing(tmp_path):
    """gemma4_ple: layers 0-2 own KV (sliding 2x16, full 2x32, sliding 2x16); layer 3
    reads layer 2's cache and layer 4 layer 1's; the reported KV bytes count owners only."""
    make_hf_model("gemma4_ple", tmp_path)
    runner = _runner(tmp_path)
    assert runner.kv_cache_specs() == [(2, 16), (2, 32), (2, 16)]
    assert [tuple(k.shape[2:]) for k, _ in runner.kv_caches] == [(2, 16), (2, 32), (2, 16)]
    assert runner.model.cache_index == [0, 1, 2, 2, 1]
    layers = runner.model.model.layers
    assert layers[3].mlp.down_proj.weight.shape[1] == 2 * layers[0].mlp.down_proj.weight.shape[1]
    hf = text_part({"num_hidden_layers": 5, "vocab_size": 512})
    facts = model_facts(tmp_path, hf, "m", runner.kv_cache_specs(), torch.float32)
    assert facts.kv_bytes_per_token == 2 * (32 + 64 + 32) * 4


# released google/gemma-4-26B-A4B-it text_config (the bench shape) and what it must give
def test_released_moe_config_parses_to_its_shapes():
    args = Gemma4Args.from_hf_config(MODEL_SHAPES["gemma4-26b-moe"])
    full = [i for i, t in enumerate(args.layer_types) if t == "full_attention"]
    assert full == [5, 11, 17, 23, 29]
    assert {args.head_dims[i] for i in full} == {512}
    assert {args.num_kv_heads[i] for i in full} == {2}
    assert args.head_dims[0] == 256 and args.num_kv_heads[0] == 8
    assert args.k_eq_v == tuple(t == "full_attention" for t in args.layer_types)
    assert args.kv_source_layers == tuple(range(30))
    assert (args.num_experts, args.top_k_experts, args.moe_intermediate_size) == (128, 8, 704)
    assert args.per_layer_input_size == 0
    assert args.ropes["full_attention"]["rope_type"] == "proportional"


def test_bench_shape_builds_at_full_size_on_meta():
    """The whole 26B-A4B text decoder, built on the meta device (no memory), holds exactly
    the parameters its config implies, counted by hand here (~25.2B, the release's
    figure): sliding layers q/k/v/o at 16 heads (8 KV) of 256, full layers q/k/o at 16
    heads (2 KV) of 512, a 2112-wide dense MLP, 128 experts of 704, the router, 7 norms of
    2816 (+ q/k norms of the head dim), the layer scalar; tied embeddings."""
    model = build_model(
        MODEL_SHAPES["gemma4-26b-moe"], torch.device("meta"), torch.bfloat16, TPGroup()
    )
    h, vocab, experts = 2816, 262144, 128
    sliding_attention = h * 16 * 256 * 2 + h * 8 * 256 * 2 + 2 * 256
    full_attention = h * 16 * 512 * 2 + h * 2 * 512 + 2 * 512
    mlp_and_experts = 3 * h * 2112 + experts * 3 * h * 704 + experts * h + h + experts
    per_layer = mlp_and_experts + 7 * h + 1
    expected = 25 * sliding_attention + 5 * full_attention + 30 * per_layer + vocab * h + h
    assert sum(p.numel() for p in model.parameters()) == expected
    assert round(expected / 1e9, 1) == 25.2
    assert all(layer.experts.w13_weight.shape == (128, 1408, 2816) for layer in model.model.layers)


def _tiny_text_config(**changes) -> dict:
    cfg = {"architectures": ["Gemma4ForCausalLM"], "vocab_size": 64, "hidden_size": 32}
    return {**cfg, "num_hidden_layers": 2, "hidden_size_per_layer_input": 0, **changes}


@pytest.mark.parametrize(
    "changes,field",
    [
        ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention"),
        ({"attention_bias": True}, "attention_bias"),
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        (
            {
                "rope_parameters": {
                    "sliding_attention": {"rope_type": "yarn", "factor": 4.0},
                    "full_attention": {"rope_type": "default"},
                }
            },
            "rope_type 'yarn'",
        ),
        ({"per_layer_config": {"1": {"sliding_window": 8}}}, "per_layer_config[1]"),
        ({"num_kv_shared_layers": 2}, "num_kv_shared_layers=2"),
    ],
)
def test_unsupported_config_is_refused_naming_the_field(changes, field):
    with pytest.raises(NotImplementedError, match=field.replace("[", r"\[").replace("]", r"\]")):
        build_model(_tiny_text_config(**changes), torch.device("cpu"), torch.float32, TPGroup())


def test_wrapper_config_folds_in_its_text_part():
    wrapper = {
        "architectures": ["Gemma4ForConditionalGeneration"],
        "model_type": "gemma4",
        "eos_token_id": [1, 106],
        "text_config": {"model_type": "gemma4_text", "eos_token_id": 1, "hidden_size": 32},
        "vision_config": {"model_type": "gemma4_vision"},
    }
    folded = text_part(wrapper)
    assert folded["eos_token_id"] == [1, 106] and folded["hidden_size"] == 32
    assert folded["model_type"] == "gemma4_text" and "vision_config" not in folded
    other = {"architectures": ["Gemma3ForConditionalGeneration"], "text_config": {}}
    assert text_part(other) is other


def test_quantization_fp8_at_load_equals_its_dequantised_weights(tmp_path):
    """``--quantization fp8`` on the MoE model: attention, dense MLP and the stacked
    experts become e4m3 (the router and per-layer scales stay); its logprobs equal those
    of the fp32 model holding the dequantised weights (atol 1e-4, same greedy tokens).
    Against the fp32 original the difference is up to ~0.4 in logprob on this random
    model (Gemma 3's tiny model: 0.05): attention at scale 1 over RMS-normed q and k
    amplifies e4m3's ~6% weight error, so that bound is only printed."""
    from vtllm.worker.layers.fp8 import quantized_modules
    from vtllm.worker.loader.quant_config import Fp8Config

    from .test_fp8_weights import FP8, _logprobs

    make_hf_model("gemma4_moe", tmp_path)
    fp8_logprobs, runner = _logprobs(tmp_path, quantization="fp8")
    original_logprobs, _ = _logprobs(tmp_path)
    dense_runner = ModelRunner.from_model_dir(tmp_path, torch.device("cpu"), torch.float32, 0)
    layer = runner.model.model.layers[1]
    assert layer.self_attn.qkv_proj.weight.dtype == FP8
    assert layer.experts.w13_weight.dtype == FP8 and layer.experts.w2_weight.dtype == FP8
    assert layer.router.proj.weight.dtype == torch.float32
    modules = dict(runner.model.named_modules())
    with torch.no_grad():
        for name, module in quantized_modules(dense_runner.model, Fp8Config(None, ())):
            quantized = modules[name]
            for prefix in ("w13_", "w2_") if hasattr(module, "w13_weight") else ("",):
                weight = getattr(quantized, f"{prefix}weight").float()
                scale = getattr(quantized, f"{prefix}weight_scale")
                getattr(module, f"{prefix}weight").copy_(weight * scale[..., None])
    dequantised_logprobs = _teacher_forced_logprobs(dense_runner)
    torch.testing.assert_close(fp8_logprobs, dequantised_logprobs, atol=1e-4, rtol=0)
    assert torch.equal(fp8_logprobs.argmax(-1), dequantised_logprobs.argmax(-1))
    print(f"fp8 vs fp32 original: {float((fp8_logprobs - original_logprobs).abs().max()):.3f}")


def _teacher_forced_logprobs(runner: ModelRunner) -> torch.Tensor:
    """``test_fp8_weights._logprobs``'s prefill and teacher-forced decodes, on a runner."""
    from .test_fp8_weights import FORCED, PROMPT

    runner.init_kv_cache(num_blocks=32, block_size=4)
    rows, next_tokens = [], [*FORCED, 0]

    def execute(step):
        rows.append(full_logprobs(runner.execute(step), 0, VOCAB_SIZE))
        return ModelRunnerOutput(step.step_id, ["a"], [next_tokens.pop(0)])

    engine = EngineSim(execute, num_blocks=32, block_size=4)
    engine.add("a", PROMPT, SamplingParams(temperature=0.0, logprobs=VOCAB_SIZE))
    engine.step({"a": len(PROMPT)})
    for _ in FORCED:
        engine.step({"a": 1})
    return torch.stack(rows)


def test_fp8_checkpoint_with_per_expert_tensors_equals_its_dequantised_twin(tmp_path):
    """An FP8 Gemma 4 MoE checkpoint as llm-compressor writes it (compressed-tensors,
    per-channel ``weight_scale``; attention, dense MLP and every expert in e4m3, the
    experts one tensor each: ``experts.{e}.gate_proj.weight``) gives exactly the logprobs
    of the fp32 checkpoint of its dequantised weights, written stacked as transformers
    does (``experts.gate_up_proj``)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from .test_fp8_weights import FP8, LAYOUTS, LINEARS, _logprobs, _quantize

    make_hf_model("gemma4_moe", tmp_path / "src")
    layout = LAYOUTS["ct-channel"]
    quantized, dequantized = {}, {}
    for name, tensor in load_file(tmp_path / "src" / "model.safetensors").items():
        prefix, _, last = name.rpartition(".")
        if last in ("gate_up_proj", "down_proj") and prefix.endswith(".experts"):
            inter = tensor.shape[1] // 2
            parts = {"gate_proj": slice(0, inter), "up_proj": slice(inter, None)}
            if last == "down_proj":
                parts = {"down_proj": slice(None)}
            stacked = []
            for expert in range(tensor.shape[0]):
                rows = []
                for proj, part in parts.items():
                    w_fp8, scale, deq = _quantize(tensor[expert, part], layout)
                    quantized[f"{prefix}.{expert}.{proj}.weight"] = w_fp8
                    quantized[f"{prefix}.{expert}.{proj}.weight_scale"] = scale
                    rows.append(deq)
                stacked.append(torch.cat(rows))
            dequantized[name] = torch.stack(stacked)
        elif last == "weight" and prefix.rpartition(".")[2] in LINEARS:
            w_fp8, scale, dequantized[name] = _quantize(tensor, layout)
            quantized[name], quantized[name + "_scale"] = w_fp8, scale
        else:
            quantized[name] = dequantized[name] = tensor
    for directory, tensors in (("fp8", quantized), ("dequantised", dequantized)):
        shutil.copytree(
            tmp_path / "src", tmp_path / directory, ignore=shutil.ignore_patterns("*.safetensors")
        )
        save_file(tensors, tmp_path / directory / "model.safetensors")
    config = json.loads((tmp_path / "src" / "config.json").read_text())
    (tmp_path / "fp8" / "config.json").write_text(
        json.dumps({**config, "quantization_config": layout})
    )
    fp8_logprobs, runner = _logprobs(tmp_path / "fp8")
    assert torch.equal(fp8_logprobs, _logprobs(tmp_path / "dequantised")[0])
    experts = runner.model.model.layers[0].experts
    assert experts.w13_weight.dtype == FP8 and experts.w2_weight.dtype == FP8


def test_fp8_checkpoint_with_unquantised_stacked_experts(tmp_path):
    """An FP8 checkpoint whose exporter quantised only the ``nn.Linear`` modules (the
    stacked 3-D experts stay in the original dtype, as in the FP8-dynamic Gemma 4 26B
    exports): it loads, its experts are quantised per row at load, and it gives the
    logprobs of its dequantised twin served with ``--quantization fp8`` (within 1e-4:
    re-quantising a dequantised row may move its scale by one ulp)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from .test_fp8_weights import FP8, LAYOUTS, LINEARS, _logprobs, _quantize

    make_hf_model("gemma4_moe", tmp_path / "src")
    layout = LAYOUTS["ct-channel"]
    quantized, dequantized = {}, {}
    for name, tensor in load_file(tmp_path / "src" / "model.safetensors").items():
        prefix, _, last = name.rpartition(".")
        if last == "weight" and prefix.rpartition(".")[2] in LINEARS:
            w_fp8, scale, dequantized[name] = _quantize(tensor, layout)
            quantized[name], quantized[name + "_scale"] = w_fp8, scale
        else:
            quantized[name] = dequantized[name] = tensor
    for directory, tensors in (("fp8", quantized), ("dequantised", dequantized)):
        shutil.copytree(
            tmp_path / "src", tmp_path / directory, ignore=shutil.ignore_patterns("*.safetensors")
        )
        save_file(tensors, tmp_path / directory / "model.safetensors")
    config = json.loads((tmp_path / "src" / "config.json").read_text())
    (tmp_path / "fp8" / "config.json").write_text(
        json.dumps({**config, "quantization_config": layout})
    )
    fp8_logprobs, runner = _logprobs(tmp_path / "fp8")
    twin_logprobs, _ = _logprobs(tmp_path / "dequantised", quantization="fp8")
    torch.testing.assert_close(fp8_logprobs, twin_logprobs, atol=1e-4, rtol=0)
    experts = runner.model.model.layers[0].experts
    assert experts.w13_weight.dtype == FP8 and experts.w2_weight_scale.shape == (8, 64)
