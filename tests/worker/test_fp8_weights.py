"""FP8 (e4m3) weights through the real loader and model runner on CPU: tiny random Qwen3 and
Qwen3-MoE checkpoints quantised here, in the test, to the Hugging Face layouts (vLLM fp8
``weight_scale`` per tensor with static ``input_scale``; DeepSeek / Qwen3-FP8
``weight_scale_inv`` blocks, bf16 as Qwen3-FP8 stores them; compressed-tensors per-channel ``weight_scale [N, 1]``), plus
``--quantization fp8`` on the fp32 checkpoint.

What is compared (prefill, then teacher-forced decode steps, full-vocab logprobs):

* the FP8 checkpoint against an fp32 checkpoint of its dequantised weights (``w_fp8 *
  scale`` written by this test): **exactly equal** (the CPU path is the dequantising
  reference, so any loader slip — a shard's scale at the wrong offset — shows);
* the FP8 model against the fp32 original: logprobs within ``FP8_ATOL`` (e4m3 keeps 3
  mantissa bits; over these tiny models the worst logprob moves by 0.024-0.035) and the same
  argmax on every row;
* tensor parallelism (two gloo ranks): block-scaled FP8 Qwen3-MoE against transformers on
  the dequantised checkpoint, within the fp32 tolerance of the other TP tests.
"""

from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
import transformers
from safetensors.torch import load_file, save_file

from vtllm.protocol.messages import ModelRunnerOutput, SamplingParams
from vtllm.worker.layers.cpu_quant import choose_quantization
from vtllm.worker.loader.quant_config import resolve_quantization
from vtllm.worker.model_runner import ModelRunner

from .moe_tp_rank import run_rank
from .test_llama_vs_transformers import ATOL
from .tiny_models import VOCAB_SIZE, EngineSim, full_logprobs, hf_last_logprobs, make_hf_model

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
FP8_ATOL = 0.05
PROMPT, FORCED = [5, 9, 17, 33, 65, 1, 7, 11], [100, 4, 250, 8, 42]
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MOE_OVERRIDES = dict(moe_intermediate_size=32)  # expert rows on 16-row scale blocks
LAYOUTS = {
    "fp8-tensor-static": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "static"},
    "fp8-block": {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [16, 32],
    },
    "ct-channel": {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
                "input_activations": {"num_bits": 8, "type": "float", "dynamic": True},
            }
        },
        "ignore": ["lm_head"],
    },
}


def _quantize(w: torch.Tensor, layout: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(w_fp8, scale as the checkpoint stores it, dequantised fp32 weight)``, written
    out block by block, independently of vtllm's quantiser."""
    n, k = w.shape
    if "weight_block_size" in layout:
        bn, bk = layout["weight_block_size"]
    elif layout["quant_method"] == "compressed-tensors":
        bn, bk = 1, k
    else:
        bn, bk = n, k
    if (bn, bk) == (1, k):  # per channel: one row is one block
        scale = w.abs().amax(1, keepdim=True) / FP8_MAX  # [n, 1]
        w_fp8 = (w / scale).to(FP8)
        return w_fp8, scale, w_fp8.float() * scale
    scale = torch.empty(-(-n // bn), -(-k // bk))
    w_fp8 = torch.empty(n, k, dtype=FP8)
    dequantised = torch.empty(n, k)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            rows, cols = slice(i * bn, (i + 1) * bn), slice(j * bk, (j + 1) * bk)
            scale[i, j] = w[rows, cols].abs().max() / FP8_MAX
            if "weight_block_size" in layout:  # Qwen3-FP8 stores bf16 block scales;
                # rounded up a little so that no weight exceeds e4m3's 448 (that is NaN)
                scale[i, j] = (scale[i, j] * 1.01).bfloat16().float()
            w_fp8[rows, cols] = (w[rows, cols] / scale[i, j]).to(FP8)
            dequantised[rows, cols] = w_fp8[rows, cols].float() * scale[i, j]
    if "weight_block_size" in layout:
        scale = scale.bfloat16()  # exact: the values were rounded to bf16 above
    elif layout["quant_method"] == "fp8":
        scale = scale.reshape(())  # one scalar per tensor
    return w_fp8, scale, dequantised


def _write_quantized(src: Path, layout: dict, out: Path) -> tuple[Path, Path]:
    """The FP8 checkpoint ``out/fp8`` and its dequantised fp32 twin ``out/dequantised``."""
    fp8_dir, deq_dir = out / "fp8", out / "dequantised"
    quantized, dequantized = {}, {}
    for name, tensor in load_file(src / "model.safetensors").items():
        if name.endswith(".weight") and name.split(".")[-2] in LINEARS:
            w_fp8, scale, deq = _quantize(tensor, layout)
            scale_suffix = "_scale_inv" if "weight_block_size" in layout else "_scale"
            quantized[name], quantized[name + scale_suffix] = w_fp8, scale
            if layout.get("activation_scheme") == "static":  # read and skipped by vtllm
                quantized[name.removesuffix("weight") + "input_scale"] = torch.tensor(0.01)
            dequantized[name] = deq
        else:
            quantized[name] = dequantized[name] = tensor
    for directory, tensors in ((fp8_dir, quantized), (deq_dir, dequantized)):
        shutil.copytree(src, directory, ignore=shutil.ignore_patterns("*.safetensors"))
        save_file(tensors, directory / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = layout
    (fp8_dir / "config.json").write_text(json.dumps(config))
    return fp8_dir, deq_dir


def _logprobs(
    model_dir: Path,
    quantization: str | None = None,
    device: torch.device = torch.device("cpu"),
    dtype: torch.dtype = torch.float32,
):
    """(``[len(FORCED) + 1, vocab]`` logprobs of a prefill and teacher-forced decodes,
    the runner)."""
    runner = ModelRunner.from_model_dir(model_dir, device, dtype, 0, quantization=quantization)
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
    return torch.stack(rows), runner


def _assert_close_to_original(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, atol=FP8_ATOL, rtol=0)
    assert torch.equal(actual.argmax(-1), expected.argmax(-1))


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe"])
def test_fp8_checkpoint_equals_dequantised_and_tracks_fp32(kind, layout, tmp_path):
    make_hf_model(kind, tmp_path / "src", **(MOE_OVERRIDES if kind == "qwen3_moe" else {}))
    fp8_dir, deq_dir = _write_quantized(tmp_path / "src", LAYOUTS[layout], tmp_path)
    fp8_logprobs, runner = _logprobs(fp8_dir)
    dequantised_logprobs, dense_runner = _logprobs(deq_dir)
    assert torch.equal(fp8_logprobs, dequantised_logprobs)
    _assert_close_to_original(fp8_logprobs, _logprobs(tmp_path / "src")[0])
    layer = runner.model.model.layers[0]
    assert layer.self_attn.qkv_proj.weight.dtype == FP8
    assert layer.self_attn.o_proj.weight.dtype == FP8
    if kind == "qwen3_moe":
        assert layer.mlp.experts.w13_weight.dtype == FP8
        assert runner.model.model.layers[1].mlp.down_proj.weight.dtype == FP8  # dense layer
    assert runner.model.lm_head.weight.dtype == torch.float32
    assert runner.weight_bytes() < 0.75 * dense_runner.weight_bytes()


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe"])
def test_quantization_fp8_at_load(kind, tmp_path):
    """``--quantization fp8`` on the fp32 checkpoint: per-output-channel scales, each row
    within half an e4m3 step of the original, logits close to the original's."""
    hf_model = make_hf_model(kind, tmp_path, **(MOE_OVERRIDES if kind == "qwen3_moe" else {}))
    fp8_logprobs, runner = _logprobs(tmp_path, quantization="fp8")
    _assert_close_to_original(fp8_logprobs, _logprobs(tmp_path)[0])
    layer = runner.model.model.layers[0]
    qkv = layer.self_attn.qkv_proj
    assert qkv.weight.dtype == FP8 and qkv.weight_scale.shape == (qkv.weight.shape[0],)
    original = torch.cat(
        [getattr(hf_model.model.layers[0].self_attn, p).weight for p in LINEARS[:3]]
    )
    restored = qkv.weight.float() * qkv.weight_scale[:, None]
    row_max = original.abs().amax(-1, keepdim=True)
    assert ((restored - original).abs() <= row_max / 16).all()  # e4m3: 3 mantissa bits
    assert (restored.abs().amax(-1, keepdim=True) - row_max).abs().max() < 1e-6  # amax scale
    if kind == "qwen3_moe":
        experts = layer.mlp.experts
        assert experts.w13_weight.dtype == FP8
        assert experts.w13_weight_scale.shape == experts.w13_weight.shape[:2]


def test_tensor_parallel_two_ranks_block_fp8_moe(tmp_path):
    """Each rank takes its slice of every block-scale grid (q/k/v and gate/up rows,
    o/down and expert-down columns): against transformers on the dequantised weights."""
    make_hf_model("qwen3_moe", tmp_path / "src", **MOE_OVERRIDES)
    layout = {**LAYOUTS["fp8-block"], "weight_block_size": [16, 16]}  # rank slices of 16
    fp8_dir, deq_dir = _write_quantized(tmp_path / "src", layout, tmp_path)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(deq_dir, dtype=torch.float32)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out_path = str(tmp_path / "logprobs.pt")
    args = (2, port, str(fp8_dir), PROMPT, FORCED, VOCAB_SIZE, out_path)
    mp.start_processes(run_rank, args=args, nprocs=2, start_method="spawn", join=True)
    actual = torch.load(out_path)  # [len(FORCED) + 1, vocab]
    for i in range(len(FORCED) + 1):
        expected = hf_last_logprobs(hf_model.eval(), PROMPT + FORCED[:i])
        torch.testing.assert_close(actual[i], expected, atol=ATOL, rtol=0)


def test_scale_blocks_must_fit_the_packed_shards(tmp_path):
    """gate/up rows (96) do not fall on 64-row scale blocks: refused at load, naming both."""
    make_hf_model("qwen3", tmp_path / "src")
    layout = {**LAYOUTS["fp8-block"], "weight_block_size": [64, 32]}
    fp8_dir, _ = _write_quantized(tmp_path / "src", layout, tmp_path)
    with pytest.raises(ValueError, match=r"output size \(96\) is not a multiple .* \(64\)"):
        ModelRunner.from_model_dir(fp8_dir, torch.device("cpu"), torch.float32, 0)


@pytest.mark.parametrize(
    ("quantization_config", "requested", "message"),
    [
        ({"quant_method": "awq", "bits": 4}, None, "checkpoint quantization 'awq' is not"),
        ({"quant_method": "fp8", "fmt": "e5m2"}, None, "format 'e5m2' is not supported"),
        (
            {
                "quant_method": "compressed-tensors",
                "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int"}}},
            },
            None,
            "group 'g' has 4-bit int weights",
        ),
        (None, "int8", "--quantization 'int8' is not supported; supported: fp8"),
    ],
)
def test_unsupported_quantization_is_refused_in_one_line(quantization_config, requested, message):
    config = {"architectures": ["Qwen3ForCausalLM"]}
    if quantization_config:
        config["quantization_config"] = quantization_config
    with pytest.raises(ValueError, match=message) as error:
        resolve_quantization(config, requested)
    assert "\n" not in str(error.value)


def test_quantization_config_layouts_are_read():
    assert resolve_quantization({}, None) is None
    online = resolve_quantization({}, "fp8")
    assert (
        not online.checkpoint_fp8
        and online.describe() == "fp8 e4m3 (quantised at load, per-channel)"
    )
    block = resolve_quantization({"quantization_config": LAYOUTS["fp8-block"]}, "fp8")
    assert block.checkpoint_fp8 and block.weight_block_size == (16, 32)
    assert block.scale_name == "weight_scale_inv"
    channel = resolve_quantization({"quantization_config": LAYOUTS["ct-channel"]}, None)
    assert channel.weight_block_size is None and channel.ignored == ("lm_head",)


def test_quantization_flag_and_checkpoint_refusals_before_start(capsys):
    """``--quantization`` is a serve/bench flag; another method is a one-line exit 2; an
    unsupported checkpoint is refused by the launcher's model check, before any worker."""
    from tests.test_cli_vllm import parse, refused
    from vtllm.startup import StartupError, check_model_config

    assert parse("serve org/m --quantization fp8").model.quantization == "fp8"
    assert parse("bench latency --quantization fp8").model.quantization == "fp8"
    assert parse("serve org/m").model.quantization is None
    error = refused("serve org/m --quantization awq", capsys)
    assert "--quantization" in error and "'awq'" in error and "fp8" in error
    awq = {"architectures": ["Qwen3ForCausalLM"], "quantization_config": {"quant_method": "awq"}}
    with pytest.raises(StartupError, match="m: checkpoint quantization 'awq' is not supported"):
        check_model_config(awq, "m", None)
    # int8/int4 are CPU weight-only formats: the start-up check lets them through (the
    # worker serves them on a CPU and refuses them on a GPU, layers/cpu_quant.py)
    check_model_config({"architectures": ["Qwen3ForCausalLM"]}, "m", None, "int8")
    with pytest.raises(ValueError, match="--quantization int8 is a CPU format; on a GPU use fp8"):
        choose_quantization("int8", True, {}, True)
