"""The engine core: requests in, one step at a time on an executor, outputs out.

Plain Python over a ``Scheduler`` and anything with ``execute(SchedulerOutput) ->
ModelRunnerOutput`` (and the three grammar calls of ``Executor``), so unit tests drive it
with a fake executor; ``core_proc`` wraps it in sockets and a process.

Structured outputs: admitting a request with ``sampling_params.structured_output`` asks
the driver worker to compile its grammar at once (``compile_grammar``, outside any step);
the request waits in its place, unscheduled, until the ``GrammarReady`` answer (collected
at the start of each step) — compiled: it may be scheduled; failed, or not in within
``VT_GRAMMAR_COMPILE_TIMEOUT_S``: it ends with an ``INVALID_REQUEST`` error. Every request
that asked for a compile is released on the driver when it finishes, however it ends.
Requests without one cost nothing of this: no message, no wait.

Async scheduling (``--async-scheduling``): ``step`` schedules and submits step N+1 before
it collects step N, so scheduling, output handling and the IPC overlap the workers'
compute; at most one step is in flight beyond the one being collected::

    sync    schedule N ─ submit N ─ collect N ─ update N │ schedule N+1 ─ ...
    async   schedule N+1 ─ submit N+1 ─ collect N ─ update N │ schedule N+2 ─ ...
                                  (N+1 runs on the workers while N is updated)

The scheduler's output placeholders (``scheduler.py``) keep KV blocks, ``max_tokens`` and
stops exact. While a live request needs its tokens on the host before each sample
(``needs_host_tokens``: structured outputs, penalties, min_tokens, logprobs, pooling),
steps run one at a time (logged once per change). Under tensor parallelism rank 0
broadcasts each step's sampled ids to the other ranks, which feed them alike.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

from vtllm import envs
from vtllm.config import VtllmConfig, async_scheduling_enabled
from vtllm.engine_core.guards import validate_request
from vtllm.engine_core.request import Request, RequestStatus
from vtllm.engine_core.scheduler import ScheduledStep, Scheduler
from vtllm.engine_core.step_log import (
    HeartbeatSnapshot,
    LoopCounters,
    PrefillProgress,
    StepTimes,
)
from vtllm.protocol import messages as m
from vtllm.protocol.limits import Refusal, request_id_problem, resolve_max_tokens

logger = logging.getLogger(__name__)

ClientId = bytes
_BUSY_LOG_INTERVAL_S = 10.0
_LOGGED_ID_CHARS = 64
# Longest a step waits on the workers for a grammar when nothing else can be scheduled
# (the engine loop then looks at its inbox again).
_GRAMMAR_POLL_S = 0.01


def _short(request_id: str) -> str:
    """A request id fit for a log line or a message: repr, cut to a bounded length."""
    if len(request_id) <= _LOGGED_ID_CHARS:
        return repr(request_id)
    return f"{request_id[:_LOGGED_ID_CHARS]!r}... ({len(request_id)} chars)"


class Executor(Protocol):
    def submit(self, step: m.SchedulerOutput) -> None:
        """Send one step to the workers without waiting for it; steps run in order."""

    def collect(self) -> m.ModelRunnerOutput:
        """The result of the oldest submitted step not collected yet (waits for it;
        raises as the executor's deadlines say)."""

    def compile_grammar(self, request_id: str, seq: int, spec: m.StructuredOutputSpec) -> None:
        """Start compiling on the driver; never raises (a dead worker shows at the next
        step or ``take_grammar_results``)."""

    def release_grammars(self, request_ids: list[str]) -> None:
        """The driver forgets these requests' grammars; never raises."""

    def take_grammar_results(self, wait_s: float = 0.0) -> list[m.GrammarReady]:
        """Answers to ``compile_grammar`` received so far, waiting up to ``wait_s`` when
        there are none."""


@dataclass(frozen=True)
class EngineFacts:
    """Runtime facts fixed at start-up (after the KV-fit check)."""

    model_name: str
    max_model_len: int
    vocab_size: int
    num_blocks: int
    block_size: int
    eos_token_ids: tuple[int, ...]
    on_gpu: bool = False  # the workers compute on GPUs


Outputs = list[tuple[ClientId, m.RequestOutput]]


def reserve_full_sequence_warning(config: VtllmConfig, facts: EngineFacts) -> str | None:
    """The start-up warning ``--reserve-full-sequence`` deserves (None when it is off):
    a request without max_tokens reserves KV for all of max_model_len, so only as many of
    them run at once as whole max_model_len sequences fit in the pool — often one."""
    if not config.scheduler.reserve_full_sequence:
        return None
    num_whole = (facts.num_blocks - 1) * facts.block_size // facts.max_model_len
    default = config.frontend.default_max_tokens
    advice = (
        f"--default-max-tokens is {default}, so only clients that talk to the engine core "
        "directly are affected"
        if default is not None
        else "set --default-max-tokens (e.g. 512) on the frontend, or send max_tokens"
    )
    return (
        "--reserve-full-sequence is on: a request without max_tokens reserves KV for "
        f"max_model_len ({facts.max_model_len}) tokens, and the KV cache holds {num_whole} "
        f"such reservations, so at most {num_whole} of those requests run at once; {advice}"
    )


class EngineCore:
    def __init__(self, config: VtllmConfig, facts: EngineFacts, executor: Executor) -> None:
        self.config = config
        self.facts = facts
        self.executor = executor
        self.scheduler = Scheduler(
            config.scheduler,
            config.cache,
            num_blocks=facts.num_blocks,
            max_model_len=facts.max_model_len,
            eos_token_ids=facts.eos_token_ids,
        )
        self.counters = LoopCounters()
        self.progress = PrefillProgress()
        self._num_unfinished: dict[ClientId, int] = {}  # client → admitted, not finished
        self._num_busy_refused = 0
        self._busy_logged_at = -_BUSY_LOG_INTERVAL_S
        self._grammar_seq = 0
        # request id → (seq of its CompileGrammar, monotonic deadline), until answered
        self._awaiting_grammars: dict[str, tuple[int, float]] = {}
        self._grammar_ids: set[str] = set()  # live requests whose grammar the driver holds
        # steps submitted and not collected yet, oldest first (at most 2 while async),
        # each with when it was submitted (monotonic s)
        self._in_flight: deque[tuple[ScheduledStep, float]] = deque()
        self.step_times = StepTimes()
        self.async_scheduling = async_scheduling_enabled(
            config.scheduler.async_scheduling, facts.on_gpu
        )
        self._overlapping = self.async_scheduling  # what the last step did, for the log
        if config.scheduler.async_scheduling is None:
            logger.info(
                "async scheduling %s (the default on %s; --%sasync-scheduling to change it)",
                "on" if self.async_scheduling else "off",
                "GPUs" if facts.on_gpu else "CPU",
                "no-" if self.async_scheduling else "",
            )
        warning = reserve_full_sequence_warning(config, facts)
        if warning is not None:
            logger.warning(warning)

    # -- requests --------------------------------------------------------------------

    def add_request(self, client_id: ClientId, add: m.AddRequest) -> Outputs:
        """Admit a request, or finish it at once with an error that says why.

        A rule it breaks is ``ErrorCode.INVALID_REQUEST`` naming the field (HTTP 400); a
        full queue (``--max-waiting-requests``, ``--max-requests-per-client``) is
        ``ErrorCode.UNAVAILABLE``, "server busy" (HTTP 503). A request id the sender
        already uses for a live request is refused with ``duplicate_id`` set, and that
        live request goes on untouched."""
        refusal, code, duplicate = self._refusal(client_id, add)
        if refusal is None:
            self._admit(client_id, add)
            return []
        if code == m.ErrorCode.UNAVAILABLE:
            self._log_busy(refusal.message)
        else:
            logger.warning("refused request %s: %s", _short(add.request_id), refusal.message)
        output = m.RequestOutput(
            request_id=add.request_id,
            new_token_ids=[],
            finish_reason=m.FinishReason.ERROR,
            error=refusal.message,
            num_prompt_tokens=len(add.prompt_token_ids),
            error_code=code,
            error_param=refusal.param,
            duplicate_id=duplicate,
        )
        return [(client_id, output)]

    def _refusal(
        self, client_id: ClientId, add: m.AddRequest
    ) -> tuple[Refusal | None, m.ErrorCode, bool]:
        """(why ``add`` is refused or None, the error code, whether it is a duplicate of
        the sender's own live request). Cheap checks first: a flood is refused in O(1)."""
        invalid = m.ErrorCode.INVALID_REQUEST
        rules = self.config.scheduler
        problem = request_id_problem(add.request_id, rules.max_request_id_bytes)
        if problem is not None:
            return Refusal(problem, "request_id"), invalid, False
        live = self.scheduler.requests.get(add.request_id)
        if live is not None:
            own = live.client_id == client_id
            whose = "one of this client's live requests" if own else "a live request"
            message = (
                f"request id {_short(add.request_id)} is already used by {whose}, which "
                "goes on unchanged; send a unique id (e.g. a UUID) for a new request"
            )
            return Refusal(message, "request_id"), invalid, own
        if not math.isfinite(add.arrival_time):
            message = f"arrival_time must be a finite number of seconds, got {add.arrival_time}"
            return Refusal(message, "arrival_time"), invalid, False
        busy = m.ErrorCode.UNAVAILABLE
        num_own = self._num_unfinished.get(client_id, 0)
        if num_own >= rules.max_requests_per_client:
            message = (
                f"server busy: this client already has {num_own} unfinished requests, the "
                f"most one client may have (--max-requests-per-client "
                f"{rules.max_requests_per_client}); retry when some have finished"
            )
            return Refusal(message), busy, False
        num_waiting = len(self.scheduler.waiting)
        if num_waiting >= rules.max_waiting_requests:
            message = (
                f"server busy: {num_waiting} requests are already waiting, the most the "
                f"engine core queues (--max-waiting-requests {rules.max_waiting_requests}); "
                "retry later or send it to another server"
            )
            return Refusal(message), busy, False
        refusal = validate_request(
            add.prompt_token_ids,
            add.sampling_params,
            self.facts.max_model_len,
            self.facts.vocab_size,
        )
        return refusal, invalid, False

    def _admit(self, client_id: ClientId, add: m.AddRequest) -> None:
        num_prompt = len(add.prompt_token_ids)
        max_tokens = resolve_max_tokens(
            add.sampling_params.max_tokens, num_prompt, self.facts.max_model_len
        )
        request = Request(
            request_id=add.request_id,
            client_id=client_id,
            prompt_token_ids=add.prompt_token_ids,
            sampling_params=add.sampling_params,
            max_tokens=max_tokens,
            block_size=self.facts.block_size,
            arrival_time=add.arrival_time or time.time(),
            priority=add.priority,
            cache_salt=add.cache_salt,
        )
        spec = add.sampling_params.structured_output
        if spec is not None:
            self._grammar_seq += 1
            deadline = time.monotonic() + envs.VT_GRAMMAR_COMPILE_TIMEOUT_S
            self._awaiting_grammars[add.request_id] = (self._grammar_seq, deadline)
            self._grammar_ids.add(add.request_id)
            request.awaiting_grammar = True
            self.executor.compile_grammar(add.request_id, self._grammar_seq, spec)
        self.scheduler.add_request(request)
        self._num_unfinished[client_id] = self._num_unfinished.get(client_id, 0) + 1

    def _settle(self, outputs: Outputs) -> Outputs:
        """Count the requests that ``outputs`` finish out of their clients' totals, and
        release the grammars they held on the driver (one message for all)."""
        released = []
        for client_id, output in outputs:
            if output.finish_reason is None:
                continue
            left = self._num_unfinished.get(client_id, 0) - 1
            if left > 0:
                self._num_unfinished[client_id] = left
            else:
                self._num_unfinished.pop(client_id, None)
            if self._grammar_ids and output.request_id in self._grammar_ids:
                self._grammar_ids.discard(output.request_id)
                self._awaiting_grammars.pop(output.request_id, None)
                released.append(output.request_id)
        if released:
            self.executor.release_grammars(released)
        return outputs

    def _collect_grammars(self, wait_s: float) -> Outputs:
        """Apply the driver's ``GrammarReady`` answers (stale ones, for a request gone or
        an id since reused, are dropped) and the compile deadline; the outputs of the
        requests this fails (``INVALID_REQUEST``: the spec does not compile, or is too
        slow to)."""
        failed: list[tuple[Request, str]] = []
        for ready in self.executor.take_grammar_results(wait_s):
            awaited = self._awaiting_grammars.get(ready.request_id)
            if awaited is None or awaited[0] != ready.seq:
                continue
            del self._awaiting_grammars[ready.request_id]
            request = self.scheduler.requests.get(ready.request_id)
            if request is None:
                continue
            if ready.error is None:
                self.scheduler.grammar_ready(request)
            else:
                failed.append((request, f"the structured output does not compile: {ready.error}"))
        now = time.monotonic()
        limit = envs.VT_GRAMMAR_COMPILE_TIMEOUT_S if self._awaiting_grammars else 0.0
        for request_id, (_, deadline) in list(self._awaiting_grammars.items()):
            if now > deadline:
                del self._awaiting_grammars[request_id]
                message = (
                    f"the structured output's grammar did not compile within {limit:g}s "
                    "(VT_GRAMMAR_COMPILE_TIMEOUT_S); send a smaller or simpler schema or "
                    "grammar, or raise the limit"
                )
                failed.append((self.scheduler.requests[request_id], message))
        outputs: Outputs = []
        for request, message in failed:
            logger.warning("request %s: %s", _short(request.request_id), message)
            request.error = message
            self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_ERROR)
            output = msgspec.structs.replace(
                Scheduler._output(request, []), error_code=m.ErrorCode.INVALID_REQUEST
            )
            outputs.append((request.client_id, output))
        return self._settle(outputs)

    def _log_busy(self, message: str) -> None:
        """Busy refusals come in floods: one log line per ``_BUSY_LOG_INTERVAL_S`` at most."""
        self._num_busy_refused += 1
        now = time.monotonic()
        if now - self._busy_logged_at >= _BUSY_LOG_INTERVAL_S:
            logger.warning(
                "refused %d requests as busy since the last such line; latest: %s",
                self._num_busy_refused,
                message,
            )
            self._busy_logged_at, self._num_busy_refused = now, 0

    def num_unfinished(self, client_id: ClientId) -> int:
        """Requests of ``client_id`` admitted and not finished."""
        return self._num_unfinished.get(client_id, 0)

    def abort(self, request_ids: list[str], client_id: ClientId | None = None) -> Outputs:
        """Abort requests (only those owned by ``client_id`` when given); blocks are freed
        at once and each aborted request gets a final ABORT output."""
        owned = [
            rid
            for rid in request_ids
            if rid in self.scheduler.requests
            and (client_id is None or self.scheduler.requests[rid].client_id == client_id)
        ]
        finished = self.scheduler.finish_requests(owned, RequestStatus.FINISHED_ABORTED)
        for request in finished:
            self.progress.forget(request.request_id)
        return self._settle([(r.client_id, Scheduler._output(r, [])) for r in finished])

    def abort_client(self, client_id: ClientId) -> Outputs:
        owned = [r.request_id for r in self.scheduler.requests.values() if r.client_id == client_id]
        if owned:
            logger.info("client gone: aborting its %d requests", len(owned))
        return self.abort(owned, client_id)

    def fail_all(self, reason: str) -> Outputs:
        """End every request with an error the client may retry elsewhere
        (``ErrorCode.UNAVAILABLE``: the workers are gone, or the engine core stops)."""
        requests = list(self.scheduler.requests.values())
        for request in requests:
            request.error = reason
        self.scheduler.finish_requests(
            [r.request_id for r in requests], RequestStatus.FINISHED_ERROR
        )
        return self._settle(
            [
                (
                    r.client_id,
                    msgspec.structs.replace(
                        Scheduler._output(r, []), error_code=m.ErrorCode.UNAVAILABLE
                    ),
                )
                for r in requests
            ]
        )

    # -- the step --------------------------------------------------------------------

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._awaiting_grammars) or bool(self._in_flight)

    def step(self) -> tuple[Outputs, m.SchedulerStats | None]:
        """Collect compiled grammars, then schedule and submit a step, and collect the
        oldest step in flight and apply its result. Returns outputs per client and the
        collected step's stats (None when no step was collected). With only requests
        waiting for grammars, it waits up to ``_GRAMMAR_POLL_S`` for one.

        Sync (the default): the step submitted is the step collected. Async: the step
        submitted stays in flight while the one before it is collected; a step is
        collected without a new one when there is nothing to schedule, and the one in
        flight is drained first when steps must run one at a time (``_may_overlap``)."""
        outputs: Outputs = []
        if self._awaiting_grammars:
            wait_s = 0.0 if self.scheduler.has_work() or self._in_flight else _GRAMMAR_POLL_S
            outputs = self._collect_grammars(wait_s)
        overlap = self._may_overlap()
        num_collected = 0
        if self._in_flight and not overlap:
            outputs += self._finish_oldest()
            num_collected += 1
        submitted = False
        if self.scheduler.has_work():
            step = self.scheduler.schedule()
            if not self._in_flight or _has_news(step):
                self._submit(step)
                submitted = True
        if self._in_flight and (not submitted or len(self._in_flight) > int(overlap)):
            outputs += self._finish_oldest()
            num_collected += 1
        return outputs, self._stats() if num_collected else None

    def _may_overlap(self) -> bool:
        """Whether the next step may be scheduled while one is in flight: async
        scheduling is on and no live request needs its tokens on the host first."""
        if not self.async_scheduling:
            return False
        overlap = self.scheduler.num_needing_host_tokens == 0
        if overlap != self._overlapping:
            self._overlapping = overlap
            logger.info(
                "async scheduling %s",
                "resumed"
                if overlap
                else "paused: a running request needs each sampled token on the host "
                "(structured output, penalties, min_tokens, logprobs or pooling); steps run "
                "one at a time until no such request is live",
            )
        return overlap

    def _submit(self, step: ScheduledStep) -> None:
        for request_id, (num_done, num_chunk) in step.prefill_chunks.items():
            request = self.scheduler.requests[request_id]
            self.progress.begin(request_id, num_done, num_chunk, request.num_prompt_tokens)
        self.executor.submit(step.message)
        self._in_flight.append((step, time.monotonic()))
        self.counters.steps += 1
        if step.total_num_scheduled_tokens:
            self.counters.model_executions += 1

    def _finish_oldest(self) -> Outputs:
        """Collect the oldest step in flight and apply its result."""
        step, submitted_at = self._in_flight.popleft()
        result = self.executor.collect()
        self.step_times.record(
            bool(step.prefill_chunks),
            step.total_num_scheduled_tokens,
            submitted_at,
            time.monotonic(),
        )
        for request_id, (num_done, num_chunk) in step.prefill_chunks.items():
            request = self.scheduler.requests.get(request_id)
            if request is not None:
                self.progress.after(request_id, num_done + num_chunk, request.num_prompt_tokens)
        outputs = self._settle(
            [
                (request.client_id, output)
                for request, output in self.scheduler.update_from_output(step, result)
            ]
        )
        for _, output in outputs:
            if output.finish_reason is not None:
                self.progress.forget(output.request_id)
        return outputs

    def _stats(self) -> m.SchedulerStats:
        stats = self.scheduler.make_stats()
        self.counters.prefix_queries += stats.prefix_cache_queries
        self.counters.prefix_hits += stats.prefix_cache_hits
        return stats

    # -- utility calls ---------------------------------------------------------------

    def heartbeat_snapshot(self) -> HeartbeatSnapshot:
        return HeartbeatSnapshot(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_usage=self.scheduler.kv.usage,
        )

    def utility(self, method: str, args: list[Any]) -> Any:
        """Named calls from clients. Raises ValueError with a reason on refusal."""
        if method == "reset_prefix_cache":
            refusal = self.scheduler.kv.reset_prefix_cache()
            if refusal is not None:
                raise ValueError(f"cannot reset the prefix cache: {refusal}")
            return True
        if method == "get_stats":
            pool = self.scheduler.kv.pool
            return {
                "num_running": len(self.scheduler.running),
                "num_waiting": len(self.scheduler.waiting),
                "num_free_blocks": pool.num_free_blocks,
                "num_total_blocks": pool.num_usable_blocks,
                "num_cached_blocks": len(pool.cached_blocks),
                "kv_cache_usage": pool.usage,
                "num_preemptions_total": self.scheduler.num_preemptions_total,
                "prefix_cache_queries_total": self.counters.prefix_queries,
                "prefix_cache_hits_total": self.counters.prefix_hits,
                "steps_total": self.counters.steps,
                **self.step_times.totals(),
            }
        raise ValueError(f"unknown utility method {method!r}; known: reset_prefix_cache, get_stats")


def _has_news(step: ScheduledStep) -> bool:
    """Whether ``step`` gives the workers anything: tokens to compute, or requests to
    drop (an empty step is not worth a message while another is in flight)."""
    message = step.message
    return bool(message.num_scheduled_tokens or message.finished_request_ids)
