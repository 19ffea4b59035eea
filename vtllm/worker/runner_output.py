"""What a rank's ``ModelRunner.execute`` hands back: the step's ``ModelRunnerOutput``
(``make_output``), or, with async scheduling, a ``DeferredOutput`` whose sampled ids are
still being copied to the host (model_runner.py's docstring says when)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vtllm.protocol.messages import ModelRunnerOutput
from vtllm.worker.input_batch import StepBatch


@dataclass
class DeferredOutput:
    """A driver's step output whose sampled ids are still on their way to the host."""

    output: ModelRunnerOutput  # complete but for ``sampled_token_ids``
    sampled_host: torch.Tensor | None  # [num_sampled] int64 (pinned on a GPU); None: none
    event: Any | None  # passes once the copy into ``sampled_host`` is done; None: done

    def ready(self) -> bool:
        """Whether ``resolve`` would return without waiting for the device."""
        return self.event is None or self.event.query()

    def resolve(self) -> ModelRunnerOutput:
        """The output, with its sampled ids (waits for the copy if it is not done)."""
        if self.event is not None:
            self.event.synchronize()
        if self.sampled_host is not None:
            self.output.sampled_token_ids = self.sampled_host.tolist()
            self.sampled_host = None
        return self.output


def make_output(
    step_id: int, batch: StepBatch, sampled: dict[str, Any], errors: dict[str, str]
) -> ModelRunnerOutput:
    """The driver's output of one step: the sampling requests' ids and, from ``sampled``
    (the sampler's results by name), their tokens and log-probabilities."""
    request_ids = [batch.request_ids[row] for row in batch.sample_rows]
    output = ModelRunnerOutput(
        step_id=step_id,
        request_ids=request_ids,
        sampled_token_ids=sampled.get("ids", []),
        errors=errors,
    )
    if "logprobs" in sampled:
        output.logprobs = sampled["logprobs"]
        output.top_logprobs = [
            list(zip(ids[:n], lps[:n], strict=True)) if n else []
            for ids, lps, n in zip(
                sampled["top_ids"], sampled["top_logprobs"], sampled["num_top"], strict=True
            )
        ]
    return output
