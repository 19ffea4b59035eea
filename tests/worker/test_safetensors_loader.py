"""Loader: sharded files, dtype conversion, and clear errors on mismatched checkpoints."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from vtllm.worker.distributed import TPGroup
from vtllm.worker.loader.hf_config import load_hf_config
from vtllm.worker.loader.safetensors_loader import WeightLoadError, load_safetensors
from vtllm.worker.models import build_model

from .tiny_models import make_hf_model


def _build(model_dir, dtype=torch.float32):
    return build_model(load_hf_config(model_dir), torch.device("cpu"), dtype, TPGroup())


def _reshard(model_dir, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Rewrite the checkpoint as two shards in ``dtype``; returns the original tensors."""
    tensors = load_file(model_dir / "model.safetensors")
    (model_dir / "model.safetensors").unlink()
    names = sorted(tensors)
    half = len(names) // 2
    for i, part in enumerate((names[:half], names[half:])):
        shard = {n: tensors[n].to(dtype).contiguous() for n in part}
        save_file(shard, model_dir / f"model-0000{i + 1}-of-00002.safetensors")
    return tensors


def test_sharded_bf16_checkpoint_loads_and_packs(tmp_path):
    make_hf_model("qwen2", tmp_path)
    tensors = _reshard(tmp_path, torch.bfloat16)
    model = _build(tmp_path)
    load_safetensors(model, tmp_path)
    qkv = model.model.layers[1].self_attn.qkv_proj
    expected_weight = torch.cat(
        [tensors[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"]
    ).to(torch.bfloat16)
    assert qkv.weight.dtype == torch.float32
    torch.testing.assert_close(qkv.weight, expected_weight.float())
    expected_bias = torch.cat([tensors[f"model.layers.1.self_attn.{p}_proj.bias"] for p in "qkv"])
    torch.testing.assert_close(qkv.bias, expected_bias.to(torch.bfloat16).float())
    gate_up = model.model.layers[0].mlp.gate_up_proj.weight
    torch.testing.assert_close(
        gate_up[96:], tensors["model.layers.0.mlp.up_proj.weight"].to(torch.bfloat16).float()
    )


def test_missing_and_unexpected_tensors_are_named(tmp_path):
    make_hf_model("llama", tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    del tensors["model.norm.weight"]
    tensors["model.layers.0.mystery.weight"] = torch.zeros(2)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(WeightLoadError) as info:
        load_safetensors(_build(tmp_path), tmp_path)
    message = str(info.value)
    assert "model.layers.1.self_attn.qkv_proj.weight[k]" in message
    assert "model.norm.weight" in message
    assert "unexpected 1: model.layers.0.mystery.weight" in message


def test_shape_mismatch_is_named(tmp_path):
    make_hf_model("llama_tied", tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.0.mlp.down_proj.weight"] = torch.zeros(64, 95)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(WeightLoadError, match="model.layers.0.mlp.down_proj.weight: checkpoint"):
        load_safetensors(_build(tmp_path), tmp_path)


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


def test_mapped_views_equal_safetensors_own_reader_for_every_dtype(tmp_path):
    """The loader's own header parsing and zero-copy views against ``safe_open``: every
    dtype a checkpoint carries (FP8 weights and scales included), 0-d and empty tensors."""
    from safetensors import safe_open

    from vtllm.worker.loader.safetensors_file import MappedSafetensors

    generator = torch.Generator().manual_seed(0)
    values = torch.randn(3, 5, generator=generator)
    tensors = {
        "f32": values,
        "bf16": values.bfloat16(),
        "f16": values.half(),
        "i64": torch.arange(7),
        "i8": torch.arange(-3, 3, dtype=torch.int8),
        "bool": values > 0,
        "e4m3": values.to(torch.float8_e4m3fn),
        "e5m2": values.to(torch.float8_e5m2),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
    }
    path = tmp_path / "model.safetensors"
    save_file(tensors, path, metadata={"format": "pt"})
    with MappedSafetensors(path) as mapped, safe_open(str(path), "pt") as reference:
        assert sorted(mapped.names()) == sorted(tensors)
        for name in tensors:
            view, expected = mapped.tensor(name), reference.get_tensor(name)
            assert view.dtype == expected.dtype and view.shape == expected.shape, name
            assert torch.equal(_bytes(view), _bytes(expected)), name
            mapped.release(name)  # its pages go; the view refaults them from the file
            assert torch.equal(_bytes(view), _bytes(expected)), name


def test_a_truncated_shard_is_named(tmp_path):
    make_hf_model("llama", tmp_path)
    path = tmp_path / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(WeightLoadError, match=r"model\.safetensors: tensor .* byte range"):
        load_safetensors(_build(tmp_path), tmp_path)
