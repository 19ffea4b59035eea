"""--kv-cache-dtype on CPU: the flag, the dtype each platform gets, the refusals, bytes per
token and what they do to the KV pool, per-layer scales from a checkpoint, and a tiny model
served with an FP8 cache (through the kernels' torch references) against an fp32 cache."""

from __future__ import annotations

import json
import shlex

import pytest
import torch
from safetensors.torch import save_file

from vtllm.cli import _validated_config, build_parser, main
from vtllm.engine_core.guards import check_kv_cache_fits
from vtllm.protocol.messages import SamplingParams
from vtllm.worker.kv_cache_dtype import (
    dequantize_fp8_ref,
    kv_bytes_per_token,
    kv_scale_buffers,
    quantize_fp8_ref,
    resolve_kv_cache_dtype,
)
from vtllm.worker.loader.hf_config import load_hf_config, model_facts
from vtllm.worker.loader.safetensors_loader import WeightLoadError
from vtllm.worker.model_runner import ModelRunner
from vtllm.worker.platform import Platform, PlatformKind, cpu_platform, fp8_e4m3_dtype_for

from .tiny_models import VOCAB_SIZE, EngineSim, full_logprobs, make_hf_model

CUDA = Platform(PlatformKind.CUDA, torch.device("cuda", 0))  # described only, never used


def _parse(cmdline: str):
    parser = build_parser()
    return _validated_config(parser, parser.parse_args(shlex.split(cmdline)))


def test_flag_takes_vllm_names_and_refuses_others(capsys):
    assert _parse("serve m").cache.kv_cache_dtype == "auto"
    assert _parse("serve m --kv-cache-dtype fp8").cache.kv_cache_dtype == "fp8"
    assert _parse("serve m --kv-cache-dtype fp8_e4m3").cache.kv_cache_dtype == "fp8_e4m3"
    assert _parse("serve m --kv-cache-dtype bf16").cache.kv_cache_dtype == "bfloat16"
    with pytest.raises(SystemExit) as exc:
        main(shlex.split("serve m --kv-cache-dtype fp8_e5m2"))
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "fp8_e5m2" in err and "fp8_e4m3" in err and "\n" not in err, err


def test_each_platform_gets_the_e4m3_its_hardware_converts():
    assert fp8_e4m3_dtype_for(PlatformKind.CUDA) == torch.float8_e4m3fn
    assert fp8_e4m3_dtype_for(PlatformKind.ROCM, "gfx942:sramecc+:xnack-") == torch.float8_e4m3fnuz
    assert fp8_e4m3_dtype_for(PlatformKind.ROCM, "gfx950") == torch.float8_e4m3fn
    assert fp8_e4m3_dtype_for(PlatformKind.ROCM, "gfx1201") == torch.float8_e4m3fn
    assert fp8_e4m3_dtype_for(PlatformKind.CPU) == torch.float8_e4m3fn


def test_resolve_and_refusals():
    bf16, cpu = torch.bfloat16, cpu_platform()
    assert resolve_kv_cache_dtype("auto", bf16, CUDA, "triton") == bf16
    assert resolve_kv_cache_dtype("auto", torch.float32, cpu, "torch") == torch.float32
    assert resolve_kv_cache_dtype("float16", torch.float32, cpu, "torch") == torch.float16
    assert resolve_kv_cache_dtype("fp8", bf16, CUDA, "triton") == torch.float8_e4m3fn
    assert resolve_kv_cache_dtype("fp8_e4m3", bf16, CUDA, "triton") == torch.float8_e4m3fn
    with pytest.raises(ValueError, match="needs a CUDA or ROCm GPU") as cpu_refusal:
        resolve_kv_cache_dtype("fp8", torch.float32, cpu, "torch")
    message = str(cpu_refusal.value)
    assert "\n" not in message and "drop --kv-cache-dtype" in message
    with pytest.raises(ValueError, match="VT_ATTENTION_BACKEND=torch; unset"):
        resolve_kv_cache_dtype("fp8", bf16, CUDA, "torch")


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e4m3fnuz])
def test_quantise_round_trip_and_saturation(fp8):
    limit = torch.finfo(fp8).max
    scale = 0.02
    x = torch.linspace(-4.0, 4.0, 1001)  # |x / scale| up to 200: inside both formats
    back = dequantize_fp8_ref(quantize_fp8_ref(x, scale, fp8), scale)
    normal = x.abs() >= scale * 2**-6  # e4m3's normal range, 3 mantissa bits
    assert ((back - x).abs() <= x.abs() * 2**-4)[normal].all()
    assert ((back - x).abs() <= scale * 2**-9)[~normal].all()
    assert quantize_fp8_ref(x, scale, fp8).dtype == fp8
    outliers = torch.tensor([1e6, -1e6, float("inf")])
    assert quantize_fp8_ref(outliers, 1.0, fp8).float().tolist() == [limit, -limit, limit]
    # the scale is a divisor: x = 3 * scale is stored as 3
    assert quantize_fp8_ref(torch.tensor([0.75]), 0.25, fp8).float().item() == 3.0


def test_fp8_halves_bytes_per_token_and_doubles_the_pool(qwen3_dir):
    hf = load_hf_config(qwen3_dir)
    bf16 = model_facts(qwen3_dir, hf, "m", [(2, 32)] * 2, torch.bfloat16).kv_bytes_per_token
    fp8 = model_facts(qwen3_dir, hf, "m", [(2, 32)] * 2, torch.float8_e4m3fn).kv_bytes_per_token
    # K and V x 2 layers x 2 KV heads x head_dim 32 x element bytes
    assert (bf16, fp8) == (2 * 2 * 2 * 32 * 2, 2 * 2 * 2 * 32 * 1)
    assert kv_bytes_per_token(48, 4, 128, torch.float8_e4m3fnuz) == 48 * 1024
    # the same memory holds twice the blocks, so a longer max_model_len fits
    usable = 10 * 2**20
    fits = {
        name: check_kv_cache_fits(
            usable_kv_bytes=usable,
            kv_bytes_per_token=per_token,
            block_size=16,
            model_max_len=10**6,
            pinned_max_model_len=None,
        )
        for name, per_token in (("bf16", bf16), ("fp8", fp8))
    }
    assert fits["fp8"].num_blocks == 2 * fits["bf16"].num_blocks == usable // (fp8 * 16)
    assert fits["fp8"].max_model_len == (fits["fp8"].num_blocks - 1) * 16


def test_checkpoint_scale_names():
    layer = "model.layers.3"
    assert kv_scale_buffers(f"{layer}.self_attn.k_scale") == [f"{layer}.self_attn.k_scale"]
    assert kv_scale_buffers(f"{layer}.self_attn.v_proj.output_scale") == [
        f"{layer}.self_attn.v_scale"
    ]
    assert kv_scale_buffers(f"{layer}.self_attn.kv_scale") == [
        f"{layer}.self_attn.k_scale",
        f"{layer}.self_attn.v_scale",
    ]
    assert kv_scale_buffers(f"{layer}.self_attn.k_proj.weight") == []
    assert kv_scale_buffers(f"{layer}.self_attn.k_proj.weight_scale") == []


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3")
    make_hf_model("qwen3", path)
    return path


def _with_scales(model_dir, tmp_path, scales: dict[str, torch.Tensor]):
    """A copy of the checkpoint with an extra shard of KV scales."""
    tmp_path.mkdir()
    for item in model_dir.iterdir():
        (tmp_path / item.name).write_bytes(item.read_bytes())
    save_file(scales, str(tmp_path / "zz-kv-scales.safetensors"))
    return tmp_path


def test_checkpoint_scales_fill_the_layers_and_bad_ones_are_refused(qwen3_dir, tmp_path):
    scales = {
        "model.layers.0.self_attn.k_scale": torch.tensor(0.5),
        "model.layers.0.self_attn.v_scale": torch.tensor([0.25]),
        "model.layers.1.self_attn.kv_scale": torch.tensor(0.125, dtype=torch.bfloat16),
    }
    model_dir = _with_scales(qwen3_dir, tmp_path / "good", scales)
    runner = ModelRunner.from_model_dir(model_dir, torch.device("cpu"), torch.float32, seed=0)
    layers = [layer.self_attn for layer in runner.model.model.layers]
    assert [(a.k_scale.item(), a.v_scale.item()) for a in layers] == [(0.5, 0.25), (0.125, 0.125)]
    assert layers[0].k_scale.dtype == torch.float32
    default = ModelRunner.from_model_dir(qwen3_dir, torch.device("cpu"), torch.float32, seed=0)
    assert all(a.self_attn.k_scale.item() == 1.0 for a in default.model.model.layers)
    bad = {"model.layers.0.self_attn.k_scale": torch.tensor([0.5, 0.5])}
    with pytest.raises(WeightLoadError, match="only per-tensor scales"):
        ModelRunner.from_model_dir(
            _with_scales(qwen3_dir, tmp_path / "bad", bad), torch.device("cpu"), torch.float32, 0
        )


def _serve(model_dir, kv_cache_dtype: torch.dtype | None):
    """Three requests: a chunked prefill beside whole ones, then greedy decodes; the
    kernels' contract (their torch references on CPU)."""
    runner = ModelRunner.from_model_dir(
        model_dir, torch.device("cpu"), torch.float32, seed=0, kv_cache_dtype=kv_cache_dtype
    )
    runner.init_kv_cache(num_blocks=32, block_size=4)
    runner.attention_backend = "triton"
    engine = EngineSim(runner.execute, num_blocks=32, block_size=4)
    greedy = SamplingParams(temperature=0.0, logprobs=VOCAB_SIZE)
    engine.add("a", list(range(3, 23)), greedy)
    engine.add("b", [5, 6, 7, 9, 11, 13, 17], greedy)
    engine.add("c", [40, 41, 42], greedy)
    outputs = [engine.step({"a": 12, "b": 7, "c": 3})]
    schedule = {"a": 8, "b": 1, "c": 1}
    for _ in range(5):
        outputs.append(engine.step(schedule))
        schedule = {"a": 1, "b": 1, "c": 1}
    return runner, outputs


def test_tiny_model_with_fp8_cache_follows_fp32_cache(qwen3_dir):
    """Accuracy of the FP8 cache on a tiny random Qwen3 (fp32 weights): same greedy
    tokens, every full-vocab logprob within 0.06 of the fp32-cache run (measured: 0.02
    after the prefill). Without the per-layer scales on both paths, or with K/V written
    to the wrong slots, this drifts by far more."""
    fp8_runner, fp8 = _serve(qwen3_dir, torch.float8_e4m3fn)
    _, reference = _serve(qwen3_dir, None)
    assert fp8_runner.kv_caches[0][0].dtype == torch.float8_e4m3fn
    worst = 0.0
    for expected, actual in zip(reference, fp8, strict=True):
        assert actual.request_ids == expected.request_ids
        assert actual.sampled_token_ids == expected.sampled_token_ids
        for i in range(len(expected.request_ids)):
            diff = full_logprobs(actual, i, VOCAB_SIZE) - full_logprobs(expected, i, VOCAB_SIZE)
            worst = max(worst, diff.abs().max().item())
    print(f"fp8 vs fp32 KV: worst logprob difference {worst:.4f}")
    assert 0.0 < worst < 0.06


def test_runner_allocates_the_cache_in_its_kv_dtype(qwen3_dir):
    runner = ModelRunner.from_model_dir(
        qwen3_dir, torch.device("cpu"), torch.float32, 0, kv_cache_dtype=torch.float8_e4m3fn
    )
    runner.init_kv_cache(num_blocks=4, block_size=8)
    k_cache, v_cache = runner.kv_caches[0]
    assert k_cache.dtype == v_cache.dtype == torch.float8_e4m3fn
    assert k_cache.element_size() == 1
    config = json.loads((qwen3_dir / "config.json").read_text())
    assert k_cache.shape == (4, 8, config["num_key_value_heads"], config["head_dim"])


def test_worker_logs_the_kv_dtype_and_the_scales_in_use(qwen3_dir, caplog):
    from vtllm.config import VtllmConfig
    from vtllm.worker.worker import _log_kv_cache_dtype

    runner = ModelRunner.from_model_dir(qwen3_dir, torch.device("cpu"), torch.float32, 0)
    runner.model.model.layers[1].self_attn.k_scale.fill_(0.5)
    config = VtllmConfig()
    config.cache.kv_cache_dtype = "fp8"
    with caplog.at_level("INFO", logger="vtllm"):
        _log_kv_cache_dtype(config, runner, torch.float8_e4m3fn, 512)
    assert caplog.messages[-1] == (
        "KV cache dtype float8_e4m3fn (--kv-cache-dtype fp8): 512 bytes/token; "
        "scales k_scale 0.5..1, v_scale 1"
    )


def test_a_cpu_worker_refuses_fp8_before_loading(qwen3_dir, tmp_path, monkeypatch):
    """The worker process itself (no GPU visible) answers --kv-cache-dtype fp8 with a
    WorkerFailure naming the fix, and exits 1."""
    import multiprocessing
    import socket

    from vtllm.config import VtllmConfig
    from vtllm.protocol import messages as m
    from vtllm.worker.worker import run_worker

    from .test_worker_process import FakeEngine, _join

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "")
    config = VtllmConfig()
    config.cache.kv_cache_dtype = "fp8"
    address = f"ipc://{tmp_path}/engine.sock"
    engine = FakeEngine(address)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dist_address = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    proc = multiprocessing.get_context("spawn").Process(
        target=run_worker,
        args=(config.to_bytes(), str(qwen3_dir), 0, 1, address, dist_address),
    )
    proc.start()
    try:
        _, message = engine.receive()
        assert isinstance(message, m.WorkerFailure), message
        first_line = message.message.splitlines()[0]
        assert first_line.startswith("ValueError: --kv-cache-dtype fp8 needs a CUDA or ROCm GPU")
        assert "drop --kv-cache-dtype" in first_line
        assert _join([proc]) == [1]
    finally:
        _join([proc], timeout_s=1.0)
        engine.close()
