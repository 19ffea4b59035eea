"""A CPU install has no Triton (it comes with torch on CUDA/ROCm hosts; on CPU it is a test
extra): the worker must still import and run a model on CPU, and a GPU kernel launched
without Triton must say so. Triton is hidden by a ``triton`` package on PYTHONPATH whose
import fails, as it does where triton is not installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from vtllm.worker.kernels import _triton, activation, fused_moe, paged_attention
    from vtllm.worker.kernels import reshape_and_cache, rms_norm, rotary
    from vtllm.worker.model_runner import ModelRunner

    assert not _triton.HAVE_TRITON
    runner = ModelRunner.from_model_dir(
        sys.argv[1], torch.device("cpu"), torch.float32, seed=0, load_format="dummy"
    )
    runner.init_kv_cache(num_blocks=8, block_size=4)
    runner.dummy_run(6)
    try:
        rms_norm.rms_norm(torch.ones(2, 64), torch.ones(64), 1e-6)
    except ImportError as e:
        assert "Triton is not installed" in str(e), e
    else:
        raise AssertionError("a kernel ran without Triton")
    print("ok")
    """
)


def test_cpu_worker_runs_without_triton(tmp_path: Path) -> None:
    hidden = tmp_path / "hide" / "triton"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ImportError('No module named triton (hidden)')\n")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "vocab_size": 128,
                "hidden_size": 64,
                "intermediate_size": 96,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "max_position_embeddings": 64,
                "rms_norm_eps": 1e-6,
                "eos_token_id": 2,
            }
        )
    )
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": f"{tmp_path / 'hide'}{os.pathsep}{root}"}
    env.pop("TRITON_INTERPRET", None)
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(model)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-4000:]
