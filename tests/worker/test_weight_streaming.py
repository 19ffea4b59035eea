"""Weights stream from the checkpoint: the loader's host memory is one tensor, not the model.

A Qwen3-MoE-shaped checkpoint of 61 MiB in three shards (102 tensors, the largest the 16 MiB
embedding and LM head) loads in a fresh interpreter, so nothing else this test session did
shows in its memory. On CPU the model's own parameters are host memory, so the child faults
them in first (zero-fills them) and then opens a ``HostPeakWindow`` (kernel ``VmHWM``, reset
at the window's start) around ``load_safetensors`` alone. The bound::

    peak RSS - RSS before loading  <=  largest checkpoint tensor + 5 MiB

Loading a whole shard into a dict (``safetensors.torch.load_file``) breaks it, and the child
measures exactly that as a control, so the measurement is shown able to see the failure.
So does the earlier ``safe_open`` + ``get_tensor`` loader (each tensor copied out of a
mapping whose pages stayed resident until the file closed): +26.8 MiB here, against +16.3
MiB now; as rank 1 of 2, +18.4 MiB against +8.2 MiB (the second test's bound is 13 MiB).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

# what a tensor's pages can bring beside it: the page-cache folio at each edge (up to 2 MiB
# each: a fault maps the whole folio) and ~1 MiB of Python
_SLACK_BYTES = 5 * 2**20
_CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 384,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "vocab_size": 16384,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}


def _checkpoint_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Hugging Face Qwen3-MoE checkpoint of ``cfg``, by name."""
    h, v, d = cfg["hidden_size"], cfg["vocab_size"], cfg["head_dim"]
    heads, kv, width = (
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["moe_intermediate_size"],
    )
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        shapes |= {
            f"{p}.input_layernorm.weight": (h,),
            f"{p}.post_attention_layernorm.weight": (h,),
            f"{p}.self_attn.q_proj.weight": (heads * d, h),
            f"{p}.self_attn.k_proj.weight": (kv * d, h),
            f"{p}.self_attn.v_proj.weight": (kv * d, h),
            f"{p}.self_attn.o_proj.weight": (h, heads * d),
            f"{p}.self_attn.q_norm.weight": (d,),
            f"{p}.self_attn.k_norm.weight": (d,),
            f"{p}.mlp.gate.weight": (cfg["num_experts"], h),
        }
        for e in range(cfg["num_experts"]):
            shapes |= {
                f"{p}.mlp.experts.{e}.gate_proj.weight": (width, h),
                f"{p}.mlp.experts.{e}.up_proj.weight": (width, h),
                f"{p}.mlp.experts.{e}.down_proj.weight": (h, width),
            }
    shapes |= {"model.norm.weight": (h,), "lm_head.weight": (v, h)}
    return shapes


def _write_checkpoint(
    model_dir: Path, cfg: dict = _CONFIG, num_shards: int = 3, dtype=torch.float32
) -> int:
    """Random tensors in ``num_shards`` files (one shard in memory at a time); returns the
    checkpoint's bytes."""
    (model_dir / "config.json").write_text(json.dumps(cfg))
    shapes = list(_checkpoint_shapes(cfg).items())
    generator = torch.Generator().manual_seed(0)
    per_shard = -(-len(shapes) // num_shards)
    total = 0
    for s in range(num_shards):
        shard = {
            name: torch.randn(shape, generator=generator).to(dtype)
            for name, shape in shapes[s * per_shard : (s + 1) * per_shard]
        }
        total += sum(t.numel() * t.element_size() for t in shard.values())
        save_file(shard, model_dir / f"model-{s + 1:05d}-of-{num_shards:05d}.safetensors")
    return total


_CHILD = textwrap.dedent(
    """
    import json, sys
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file
    from vtllm.worker.distributed import TPGroup
    from vtllm.worker.loader.hf_config import load_hf_config
    from vtllm.worker.loader.host_memory import HostPeakWindow
    from vtllm.worker.loader.safetensors_loader import load_safetensors
    from vtllm.worker.models import build_model

    model_dir, rank, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    tp = TPGroup(rank=rank, size=size)  # loading needs no collective: no process group
    model = build_model(load_hf_config(model_dir), torch.device("cpu"), torch.float32, tp)
    for param in model.parameters():  # on CPU the parameters are host memory: fault them in
        param.data.zero_()
    window = HostPeakWindow()
    stats = load_safetensors(model, model_dir)
    loader = window.close()
    width = 384 // size  # this rank's rows of expert 5's up projection
    expert = model.model.layers[2].mlp.experts.w13_weight[5, width:]
    with safe_open(f"{model_dir}/model-00003-of-00003.safetensors", "pt") as f:
        full = f.get_tensor("model.layers.2.mlp.experts.5.up_proj.weight")
        loaded_right = torch.equal(expert, full.narrow(0, rank * width, width))
    window = HostPeakWindow()  # the control: one shard read whole into a dict
    tensors = load_file(f"{model_dir}/model-00001-of-00003.safetensors")
    checksum = sum(float(t.sum()) for t in tensors.values())  # read every tensor, as a loader would
    control = window.close()
    shard_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    print(json.dumps({
        "source": loader.source, "extra": loader.extra_bytes, "control_extra": control.extra_bytes,
        "shard_bytes": shard_bytes, "largest": stats.largest_tensor_bytes,
        "checkpoint_bytes": stats.checkpoint_bytes, "num_tensors": stats.num_tensors,
        "num_files": stats.num_files, "loaded_right": loaded_right,
    }))
    """
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[Path, int]:
    model_dir = tmp_path_factory.mktemp("streamed")
    return model_dir, _write_checkpoint(model_dir)


def _load_in_child(model_dir: Path, rank: int = 0, size: int = 1) -> dict:
    """Run ``_CHILD`` as tensor-parallel rank ``rank`` of ``size``; its JSON report."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    child = subprocess.run(
        [sys.executable, "-c", _CHILD, str(model_dir), str(rank), str(size)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert child.returncode == 0, child.stderr[-3000:]
    result = json.loads(child.stdout.strip().splitlines()[-1])
    if result["source"] != "VmHWM":
        pytest.skip("this kernel refuses to reset the peak RSS (/proc/self/clear_refs)")
    assert result["loaded_right"]
    return result


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux VmHWM")
def test_loader_host_memory_is_one_tensor_not_the_checkpoint(checkpoint):
    model_dir, checkpoint_bytes = checkpoint
    result = _load_in_child(model_dir)
    assert result["num_files"] == 3
    assert result["checkpoint_bytes"] == checkpoint_bytes  # every tensor read, once
    assert result["largest"] == 16384 * 256 * 4  # the embedding / LM head
    bound = result["largest"] + _SLACK_BYTES
    assert result["extra"] <= bound, (
        f"loading raised the host RSS by {result['extra'] / 2**20:.1f} MiB; one tensor "
        f"({result['largest'] / 2**20:.1f} MiB) + {_SLACK_BYTES / 2**20:.0f} MiB allowed "
        f"(checkpoint {checkpoint_bytes / 2**20:.0f} MiB)"
    )
    # the control: a whole shard in a dict must show, or the bound above proves nothing
    assert result["control_extra"] >= result["shard_bytes"] > bound


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux VmHWM")
def test_a_tensor_parallel_rank_reads_only_its_rows(checkpoint):
    """Rank 1 of 2: the largest tensors (embedding, LM head: 16 MiB each) split by rows,
    so the rank touches only its 8 MiB of their pages (+ the same slack): under 16 MiB, so
    reading them whole breaks the bound."""
    model_dir, _ = checkpoint
    result = _load_in_child(model_dir, rank=1, size=2)
    bound = result["largest"] // 2 + _SLACK_BYTES
    assert bound < result["largest"]
    assert result["extra"] <= bound, (
        f"rank 1 of 2 raised the host RSS by {result['extra'] / 2**20:.2f} MiB; its half of "
        f"the largest tensor + {_SLACK_BYTES / 2**20:.0f} MiB = {bound / 2**20:.2f} MiB allowed"
    )


@pytest.mark.gpu
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux VmHWM")
@pytest.mark.parametrize("load_format", ["auto", "dummy"])
def test_weights_go_to_the_gpu_without_the_host_holding_them(tmp_path, load_format):
    """On a GPU the host's RSS while loading stays near one tensor: a 1.6 GiB bf16
    checkpoint (~50 MiB shards of 1 MiB expert tensors; 128 MiB allowed for CUDA's staging
    and Python), and random weights of a 16 GiB model (``--load-format dummy``: initialised
    on the device)."""
    from vtllm.bench import write_shape_dir
    from vtllm.worker.model_runner import ModelRunner

    device = torch.device("cuda", 0)
    torch.zeros(1, device=device)  # the CUDA context's own host memory is not the loader's
    if load_format == "dummy":
        model_dir = write_shape_dir("llama3-8b")
    else:
        cfg = dict(_CONFIG, hidden_size=1024, num_hidden_layers=8, num_experts=64)
        cfg |= dict(moe_intermediate_size=512, num_attention_heads=8, head_dim=128)
        _write_checkpoint(tmp_path, cfg, num_shards=32, dtype=torch.bfloat16)
        model_dir = tmp_path
    runner = ModelRunner.from_model_dir(model_dir, device, torch.bfloat16, 0, None, load_format)
    peak = runner.load_host_peak
    weights = runner.weight_bytes()
    print(f"{load_format}: {weights / 2**30:.2f} GiB of weights, {peak.describe()}")
    assert peak.source == "VmHWM"
    if load_format == "dummy":
        assert weights > 14 * 2**30
        assert peak.extra_bytes < 256 * 2**20
    else:
        stats = runner.load_stats
        assert stats.checkpoint_bytes > 1.5 * 2**30 and stats.num_files == 32
        assert peak.extra_bytes <= stats.largest_tensor_bytes + 128 * 2**20
        experts = runner.model.model.layers[7].mlp.experts.w13_weight  # [64, 1024, 1024]
        assert experts.is_cuda and experts.abs().amax(dim=(1, 2)).min() > 0  # every expert loaded
    del runner
    torch.cuda.empty_cache()
