"""Embeddings: the final hidden states of a pooling request's prompt, pooled.

A pooling request (``SamplingParams.pooling``) is an ordinary request of one output token
(the frontend sends ``max_tokens=1``); on the step its prompt completes, the driver also
returns its pooled final hidden state (after the model's last norm) in
``ModelRunnerOutput.embeddings``. ``LAST``: the last prompt token's. ``MEAN``: the mean
over every prompt token, summed chunk by chunk across a chunked prefill; a request whose
prompt was not computed whole here (prefix-cache hits, a resume after preemption) gets no
embedding and a warning (the frontend gives such requests a unique cache salt, so only a
preemption mid-prompt can cause it; the client is told to retry).
"""

from __future__ import annotations

import logging

import torch

from vtllm.protocol.messages import PoolingType, SchedulerOutput
from vtllm.worker.input_batch import RequestStates, StepBatch

logger = logging.getLogger(__name__)


class Pooler:
    """Running sums of MEAN requests across their prefill chunks (driver rank)."""

    def __init__(self) -> None:
        self._sums: dict[str, tuple[torch.Tensor, int]] = {}  # id → ([hidden] fp32, tokens)

    def on_step(self, step: SchedulerOutput) -> None:
        """Forget finished requests, and restart any request sent anew (a resume)."""
        for request_id in step.finished_request_ids:
            self._sums.pop(request_id, None)
        for new in step.new_requests:
            self._sums.pop(new.request_id, None)

    def pool(
        self, batch: StepBatch, hidden: torch.Tensor, states: RequestStates
    ) -> dict[str, list[float]]:
        """Embeddings of the pooling requests whose prompt completes in ``batch``.

        ``hidden``: ``[num_tokens (or more, padded), hidden]``, row ``t`` the final hidden
        state of the batch's flat token ``t`` (a decode-graph batch has one token per
        request, so the same offsets hold)."""
        sampling = set(batch.sample_rows)
        out: dict[str, list[float]] = {}
        start = 0
        for row, (request_id, num) in enumerate(
            zip(batch.request_ids, batch.query_lens.tolist(), strict=True)
        ):
            state = states.get(request_id)
            kind = state.sampling_params.pooling if state is not None else PoolingType.NONE
            if kind == PoolingType.LAST and row in sampling:
                out[request_id] = hidden[start + num - 1].float().tolist()
            elif kind == PoolingType.MEAN:
                total, count = self._sums.pop(request_id, (None, 0))
                chunk = hidden[start : start + num].float().sum(dim=0)  # [hidden]
                total, count = (chunk if total is None else total + chunk), count + num
                if row not in sampling:
                    self._sums[request_id] = (total, count)
                elif count == state.num_prompt_tokens:
                    out[request_id] = (total / count).tolist()
                else:
                    logger.warning(
                        "request %s: mean pooling saw %d of %d prompt tokens (prefix cache or "
                        "a resume); no embedding",
                        request_id,
                        count,
                        state.num_prompt_tokens,
                    )
            start += num
        return out

    def wanted(self, batch: StepBatch, states: RequestStates) -> bool:
        """Whether any request of ``batch`` pools (most steps: none, no work)."""
        if not states.pooling_ids:
            return False
        for request_id in batch.request_ids:
            state = states.get(request_id)
            if state is not None and state.sampling_params.pooling != PoolingType.NONE:
                return True
        return False
