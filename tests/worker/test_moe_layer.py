"""The MoE layer's parts: routing rules against transformers' own router modules, expert
weight loading (names, shapes, missing experts, sharding over ranks), config refusals."""

from __future__ import annotations

import json

import pytest
import torch
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from vtllm.worker.distributed import TPGroup
from vtllm.worker.kernels.fused_moe import fused_moe_ref
from vtllm.worker.layers.moe import (
    FusedMoE,
    RouterSpec,
    expert_checkpoint_name,
    select_experts,
)
from vtllm.worker.loader.safetensors_loader import WeightLoadError, load_safetensors
from vtllm.worker.models import build_model
from vtllm.worker.models.moe_llama import MoeLlamaArgs

from .tiny_models import hf_config, make_hf_model

NUM_EXPERTS, HIDDEN, INTER, TOP_K = 8, 32, 12, 3


@pytest.mark.parametrize(
    ("router_cls", "overrides", "spec"),
    [
        (Qwen3MoeTopKRouter, {"norm_topk_prob": False}, RouterSpec(TOP_K, "softmax", False, True)),
        (Qwen3MoeTopKRouter, {"norm_topk_prob": True}, RouterSpec(TOP_K, "softmax", True, True)),
        (MixtralTopKRouter, {}, RouterSpec(TOP_K, "softmax", True, False)),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_matches_transformers(router_cls, overrides, spec, dtype):
    config = hf_config("qwen3_moe" if router_cls is Qwen3MoeTopKRouter else "mixtral")
    config.hidden_size, config.num_experts_per_tok = HIDDEN, TOP_K
    config.num_local_experts = NUM_EXPERTS
    for key, value in overrides.items():
        setattr(config, key, value)
    router = router_cls(config).to(dtype)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        router.weight.copy_(torch.randn(NUM_EXPERTS, HIDDEN, generator=generator))
        x = torch.randn(64, HIDDEN, generator=generator).to(dtype)
        logits, hf_weights, hf_ids = router(x)
    weights, ids = select_experts(logits, spec)
    assert torch.equal(ids, hf_ids)
    assert weights.dtype == hf_weights.dtype
    torch.testing.assert_close(weights, hf_weights, atol=0, rtol=0)


def test_renormalised_softmax_is_softmax_over_top_k_logits():
    """Mixtral's rule as its paper states it: the top-k logits, then a softmax over them."""
    logits = torch.randn(50, NUM_EXPERTS, generator=torch.Generator().manual_seed(2))
    weights, ids = select_experts(logits, RouterSpec(TOP_K, "softmax", renormalize=True))
    top_logits, top_ids = torch.topk(logits, TOP_K)
    assert torch.equal(ids, top_ids)
    torch.testing.assert_close(weights, top_logits.softmax(-1))


def test_sigmoid_scoring():
    logits = torch.randn(20, NUM_EXPERTS, generator=torch.Generator().manual_seed(3))
    weights, ids = select_experts(logits, RouterSpec(TOP_K, "sigmoid", renormalize=False))
    expected, expected_ids = torch.topk(logits.sigmoid(), TOP_K)
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(weights, expected)
    renormalised, _ = select_experts(logits, RouterSpec(TOP_K, "sigmoid", renormalize=True))
    torch.testing.assert_close(renormalised.sum(-1), torch.ones(20))
    with pytest.raises(ValueError, match="softmax or sigmoid"):
        select_experts(logits, RouterSpec(TOP_K, "tanh"))


def test_expert_checkpoint_names():
    qwen = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
    assert expert_checkpoint_name("model.layers.3.mlp.experts.17.up_proj.weight", qwen) == (
        "model.layers.3.mlp.experts.w13_weight",
        (17, "up"),
    )
    assert expert_checkpoint_name("model.layers.3.mlp.experts.0.down_proj.weight", qwen) == (
        "model.layers.3.mlp.experts.w2_weight",
        (0, "down"),
    )
    assert expert_checkpoint_name("model.layers.3.mlp.gate_proj.weight", qwen) is None
    assert expert_checkpoint_name("model.layers.3.mlp.experts.1.w1.weight", qwen) is None


def _full_expert_weights(generator):
    """Per-expert checkpoint tensors: gate/up ``[I, H]``, down ``[H, I]``."""
    return {
        (e, kind): torch.randn(
            *((HIDDEN, INTER) if kind == "down" else (INTER, HIDDEN)), generator=generator
        )  # fmt: skip
        for e in range(NUM_EXPERTS)
        for kind in ("gate", "up", "down")
    }


def _load_experts(experts: FusedMoE, tensors) -> None:
    for (expert, kind), tensor in tensors.items():
        param = experts.w2_weight if kind == "down" else experts.w13_weight
        experts.weight_loader(param, tensor, (expert, kind))


def _stacked(tensors):
    """The unsharded ``w13 [E, 2I, H]`` and ``w2 [E, H, I]`` the reference takes."""
    w13 = torch.stack(
        [torch.cat([tensors[e, "gate"], tensors[e, "up"]]) for e in range(NUM_EXPERTS)]
    )
    w2 = torch.stack([tensors[e, "down"] for e in range(NUM_EXPERTS)])
    return w13, w2


def test_weight_loader_places_each_expert_and_refuses_bad_shapes():
    tensors = _full_expert_weights(torch.Generator().manual_seed(4))
    experts = FusedMoE(NUM_EXPERTS, HIDDEN, INTER, TPGroup())
    _load_experts(experts, tensors)
    w13, w2 = _stacked(tensors)
    assert torch.equal(experts.w13_weight, w13) and torch.equal(experts.w2_weight, w2)
    with pytest.raises(
        ValueError, match=r"expert 2 up: checkpoint shape \(12, 31\), expected \(12, 32\)"
    ):
        experts.weight_loader(experts.w13_weight, torch.zeros(INTER, HIDDEN - 1), (2, "up"))
    with pytest.raises(ValueError, match="expert 8 out of range"):
        experts.weight_loader(experts.w2_weight, torch.zeros(HIDDEN, INTER), (8, "down"))


def test_missing_expert_tensor_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    make_hf_model("mixtral", tmp_path)
    (path,) = tmp_path.glob("*.safetensors")
    tensors = load_file(path)
    del tensors["model.layers.1.block_sparse_moe.experts.3.w3.weight"]
    save_file(tensors, path, metadata={"format": "pt"})
    cfg = json.loads((tmp_path / "config.json").read_text())
    model = build_model(cfg, torch.device("cpu"), torch.float32, TPGroup())
    with pytest.raises(
        WeightLoadError,
        match=r"missing 1: model\.layers\.1\.mlp\.experts\.w13_weight\[\(3, 'up'\)\]",
    ):
        load_safetensors(model, tmp_path)


def test_config_refusals():
    cfg = hf_config("qwen3_moe").to_dict()
    with pytest.raises(NotImplementedError, match="shared_expert_intermediate_size"):
        MoeLlamaArgs.from_hf_config({**cfg, "shared_expert_intermediate_size": 64})
    with pytest.raises(ValueError, match=r"num_experts_per_tok \(9\) must be in \[1, 8\]"):
        MoeLlamaArgs.from_hf_config({**cfg, "num_experts_per_tok": 9})
    with pytest.raises(NotImplementedError, match="'qwen2_moe' is not a supported MoE family"):
        MoeLlamaArgs.from_hf_config({**cfg, "model_type": "qwen2_moe"})
    args = MoeLlamaArgs.from_hf_config({**cfg, "decoder_sparse_step": 2, "mlp_only_layers": []})
    assert args.moe_layers == (False, True, False)


def test_two_ranks_shards_sum_to_the_unsharded_experts():
    """Each rank holds half of every expert's intermediate dim (gate/up rows, down
    columns); the two partial outputs add up to the unsharded result (the all-reduce)."""
    generator = torch.Generator().manual_seed(5)
    tensors = _full_expert_weights(generator)
    x = torch.randn(7, HIDDEN, generator=generator)
    logits = torch.randn(7, NUM_EXPERTS, generator=generator)
    weights, ids = select_experts(logits, RouterSpec(TOP_K))
    partials = []
    for rank in range(2):
        experts = FusedMoE(NUM_EXPERTS, HIDDEN, INTER, TPGroup(rank, 2))
        _load_experts(experts, tensors)
        assert experts.w13_weight.shape == (NUM_EXPERTS, INTER, HIDDEN)
        assert experts.w2_weight.shape == (NUM_EXPERTS, HIDDEN, INTER // 2)
        w13, w2 = experts.w13_weight, experts.w2_weight
        torch.testing.assert_close(w13[:, : INTER // 2], torch.stack(
            [tensors[e, "gate"][rank * 6 : rank * 6 + 6] for e in range(NUM_EXPERTS)]
        ))  # fmt: skip
        partials.append(fused_moe_ref(x, w13, w2, weights, ids))
    expected = fused_moe_ref(x, *_stacked(tensors), weights, ids)
    torch.testing.assert_close(partials[0] + partials[1], expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(
        ValueError,
        match=r"moe intermediate size \(12\) is not divisible by --tensor-parallel-size \(5\)",
    ):
        FusedMoE(NUM_EXPERTS, HIDDEN, INTER, TPGroup(0, 5))


def test_experts_match_gemma4_experts_with_gelu_tanh():
    """The hook Gemma 4 will use: ``FusedMoE`` with GeGLU experts, fed its router's
    ``(weights, ids)``, equals transformers' ``Gemma4TextExperts`` (whose stacked
    ``gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]`` are our layout)."""
    import transformers
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextExperts

    config = transformers.Gemma4TextConfig(
        hidden_size=HIDDEN,
        num_experts=NUM_EXPERTS,
        top_k_experts=TOP_K,
        moe_intermediate_size=INTER,
        enable_moe_block=True,
    )
    reference = Gemma4TextExperts(config)
    generator = torch.Generator().manual_seed(6)
    with torch.no_grad():
        reference.gate_up_proj.copy_(
            torch.randn(NUM_EXPERTS, 2 * INTER, HIDDEN, generator=generator)
        )
        reference.down_proj.copy_(torch.randn(NUM_EXPERTS, HIDDEN, INTER, generator=generator))
        x = torch.randn(9, HIDDEN, generator=generator)
        weights, ids = select_experts(
            torch.randn(9, NUM_EXPERTS, generator=generator), RouterSpec(TOP_K)
        )
        expected = reference(x, ids, weights)
    experts = FusedMoE(NUM_EXPERTS, HIDDEN, INTER, TPGroup(), activation="gelu_pytorch_tanh")
    for e in range(NUM_EXPERTS):
        gate, up = reference.gate_up_proj[e].detach().chunk(2)
        experts.weight_loader(experts.w13_weight, gate, (e, "gate"))
        experts.weight_loader(experts.w13_weight, up, (e, "up"))
        experts.weight_loader(experts.w2_weight, reference.down_proj[e].detach(), (e, "down"))
    torch.testing.assert_close(experts(x, weights, ids), expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(NotImplementedError, match="expert activation 'relu' is not supported"):
        FusedMoE(NUM_EXPERTS, HIDDEN, INTER, TPGroup(), activation="relu")


def test_decode_chain_says_which_layers_cannot_take_it():
    """The MoE decode chain's per-layer checks (``models/moe_llama.py``): every layer of
    the tiny Mixtral qualifies; Qwen3-MoE's dense layer (``mlp_only_layers``), biased
    q/k/v and two ranks are named; off a GPU no step takes it (nor is it decided)."""
    cpu = torch.device("cpu")

    def layers_why_not(kind, tp=TPGroup(), **overrides):
        cfg = {**hf_config(kind).to_dict(), **overrides}
        cfg["architectures"] = [{"mixtral": "MixtralForCausalLM"}.get(kind, "Qwen3MoeForCausalLM")]
        model = build_model(cfg, cpu, torch.float32, tp)
        return model, [layer.chain_eligible() for layer in model.model.layers]

    mixtral, why_not = layers_why_not("mixtral")
    assert why_not == [None] * len(why_not)
    assert layers_why_not("qwen3_moe")[1] == [None, "dense MLP layers", None]
    biased = layers_why_not("qwen3_moe", attention_bias=True, mlp_only_layers=[])[1]
    assert biased == ["biased q/k/v projections"] * 3
    two_ranks = layers_why_not("mixtral", TPGroup(0, 2))[1]
    assert two_ranks == ["tensor parallel over 2 ranks"] * len(two_ranks)
    hidden = mixtral.model.norm.weight.shape[0]
    assert mixtral._decode_chain_tiles(torch.zeros(1, hidden)) is None
    assert not mixtral._chain_decided
