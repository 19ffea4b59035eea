"""One rank of the CPU tensor-parallel MoE test (``test_moe_vs_transformers.py``), run in a
spawned process. Kept apart from the test module so that a child imports no transformers."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from vtllm.protocol.messages import ModelRunnerOutput, SamplingParams
from vtllm.worker.distributed import TPGroup
from vtllm.worker.model_runner import ModelRunner

from .tiny_models import EngineSim, full_logprobs


def run_rank(
    rank: int,
    world_size: int,
    port: int,
    model_dir: str,
    prompt: list[int],
    forced: list[int],
    vocab_size: int,
    out_path: str,
) -> None:
    """Prefill ``prompt``, then decode the ``forced`` tokens one per step (teacher forcing,
    so no rank needs rank 0's samples); rank 0 saves each step's full-vocab logprobs
    ``[len(forced) + 1, vocab]`` to ``out_path``."""
    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    try:
        tp = TPGroup(rank, world_size)
        runner = ModelRunner.from_model_dir(model_dir, torch.device("cpu"), torch.float32, 0, tp)
        runner.init_kv_cache(num_blocks=32, block_size=4)
        rows: list[torch.Tensor] = []
        next_tokens = list(forced) + [0]

        def execute(step):
            output = runner.execute(step)
            if output is not None:
                rows.append(full_logprobs(output, 0, vocab_size))
            return ModelRunnerOutput(step.step_id, ["a"], [next_tokens.pop(0)])

        engine = EngineSim(execute, num_blocks=32, block_size=4)
        engine.add("a", prompt, SamplingParams(temperature=0.0, logprobs=vocab_size))
        engine.step({"a": len(prompt)})
        for _ in forced:
            engine.step({"a": 1})
        if rank == 0:
            torch.save(torch.stack(rows), out_path)
    finally:
        dist.destroy_process_group()
