"""VT_ALLOW_LONG_MAX_MODEL_LEN: a --max-model-len past the model's max_position_embeddings
runs (the rope tables cover it) instead of failing at the first long position."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from vtllm.worker.model_runner import ModelRunner


@pytest.fixture
def short_context_model(tmp_path: Path) -> Path:
    config = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 16,
        "rms_norm_eps": 1e-6,
        "eos_token_id": 2,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def _runner(model_dir: Path, max_model_len: int | None) -> ModelRunner:
    runner = ModelRunner.from_model_dir(
        model_dir, torch.device("cpu"), torch.float32, 0, None, "dummy", max_model_len
    )
    runner.init_kv_cache(num_blocks=16, block_size=4)
    return runner


def test_positions_past_the_model_context(short_context_model):
    runner = _runner(short_context_model, max_model_len=40)
    assert runner.model.rotary.cos_sin_cache.shape[0] == 40
    runner.dummy_run(30)  # positions 0..29, past the model's 16
    plain = _runner(short_context_model, max_model_len=None)
    assert plain.model.rotary.cos_sin_cache.shape[0] == 16
    with pytest.raises(IndexError):
        plain.dummy_run(30)
