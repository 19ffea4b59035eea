"""One token budget per step; running requests first, then waiting ones.

Every request advances ``num_computed_tokens`` toward ``num_tokens``. Chunked prefill,
prefix hits and resumption after preemption are all that one rule:

    prompt   |■■■■■■■■■■■■■■■■■■■■|      ■ = computed, □ = scheduled this step
    step 1   |□□□□□□□□              |      (budget 8: a prefill chunk)
    step 2   |■■■■■■■■□□□□□□□□      |
    step 3   |■■■■■■■■■■■■■■■■□□□□  |→ sample one token, append, decode from here on

A waiting request that cannot get blocks now *waits* (peek and break): the start-up
guard guarantees it fits once others finish or are preempted, so it is never aborted for
transient pressure.

Long prefills share the step: one request's chunk is capped at
``long_prefill_token_threshold``, so the rest of the budget serves others (a short
prompt's whole prefill, decodes) and no step is longer than a capped chunk. The cap holds
for a lone long prompt too: requests arrive *during* a step, and a step already running
cannot be cut short, so a full-budget step would make every newcomer wait for all of it::

    budget 2048, threshold 512         step 1     step 2 (a short request arrived)
    long  |■■■■■■■■■■■■■■■■■■■■■■■■|   512        512
    short |■|                          —          its whole prefill: first token

Every scheduled request whose computed tokens reach its known tokens is *due* a sampled
token; one that gets neither a token nor an error ends with an error finish (never
RUNNING forever).

A request with a structured output waits (``awaiting_grammar``, in its place in the
queue) until the driver worker has compiled its grammar; waiting requests behind it are
scheduled meanwhile, so a slow compile holds no one but its own request.

Output placeholders (async scheduling): a step that is due to sample a request's next
token adds one to ``request.num_output_placeholders`` when it is scheduled, and its result
takes it away. While a step is in flight the next one may be scheduled: a request counts
its placeholders as tokens it will have, so it is scheduled for the position of the token
the step in flight samples (the worker feeds that token from the device)::

    known tokens  |t0 .. t9|            computed 10, placeholders 1 (step N in flight)
    step N+1      computes position 10 (input: step N's sample), placeholders 2
    N's result    appends t10, placeholders 1; if t10 ends the request, N+1's extra
                  token is dropped when it comes (the request is gone by then)

A request whose known outputs plus placeholders already reach ``max_tokens`` (or whose
tokens reach ``max_model_len``) is not scheduled for more: the step in flight decides it.
A request is identified in results by its object, not its id, so a finished request's
late token never lands on a new request that reuses the id.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from vtllm.config import CacheConfig, SchedulerConfig
from vtllm.engine_core.kv_cache_manager import KVCacheManager
from vtllm.engine_core.request import Request, RequestStatus
from vtllm.protocol import messages as m

logger = logging.getLogger(__name__)


@dataclass
class ScheduledStep:
    """What ``schedule()`` decided, before it is turned into a wire message."""

    step_id: int
    message: m.SchedulerOutput
    # request id → (tokens computed before this step, tokens scheduled)
    prefill_chunks: dict[str, tuple[int, int]] = field(default_factory=dict)
    # requests whose scheduled tokens reach their last known token: each must get a
    # sampled token (or an error) back from this step
    due_token_ids: set[str] = field(default_factory=set)
    # every request this step computes, by id: results apply only to these objects
    requests: dict[str, Request] = field(default_factory=dict)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.message.num_scheduled_tokens.values())


def needs_host_tokens(params: m.SamplingParams) -> bool:
    """Whether the worker needs every earlier sampled token of a request on the host
    before it samples the next one: structured outputs (the grammar advances on each
    token), penalties (token counts), ``min_tokens`` (output count), logprobs and pooling
    (outputs read back each step). Async scheduling runs steps one at a time while a live
    request needs them."""
    return (
        params.structured_output is not None
        or params.repetition_penalty != 1.0
        or params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
        or params.min_tokens > 0
        or params.logprobs is not None
        or params.pooling != m.PoolingType.NONE
    )


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        max_model_len: int,
        eos_token_ids: Iterable[int] = (),
    ) -> None:
        self.config = scheduler_config
        self.block_size = cache_config.block_size
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.kv = KVCacheManager(num_blocks, self.block_size, cache_config.enable_prefix_caching)
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        # ids the workers must drop state for (finished, aborted or preempted)
        self._finished_for_workers: list[str] = []
        self._step_id = 0
        self.num_awaiting_grammar = 0  # waiting requests whose grammar is not compiled yet
        self.num_needing_host_tokens = 0  # live requests for which ``needs_host_tokens``
        self.num_preemptions = 0  # since the last stats
        self.num_preemptions_total = 0

    # -- intake ----------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)
        if request.awaiting_grammar:
            self.num_awaiting_grammar += 1
        if needs_host_tokens(request.sampling_params):
            self.num_needing_host_tokens += 1

    def grammar_ready(self, request: Request) -> None:
        """``request``'s grammar is compiled: it may be scheduled from now on."""
        if request.awaiting_grammar:
            request.awaiting_grammar = False
            self.num_awaiting_grammar -= 1

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """End requests (abort, stop string hit by the client, ...); their blocks return
        to the pool at once. Unknown or already finished ids are ignored."""
        finished = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.status.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._free(request, status)
            finished.append(request)
        return finished

    def _free(self, request: Request, status: RequestStatus) -> None:
        self.grammar_ready(request)  # no longer counted as waiting for one
        if needs_host_tokens(request.sampling_params):
            self.num_needing_host_tokens -= 1
        request.status = status
        self.kv.free(request)
        del self.requests[request.request_id]
        if request.num_tokens_sent_to_workers is not None:
            self._finished_for_workers.append(request.request_id)
            request.num_tokens_sent_to_workers = None

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_work(self) -> bool:
        """Something a step can do: run or admit a request, or tell the workers to drop
        one (requests waiting only for their grammars are not work for a step)."""
        return bool(
            len(self.waiting) > self.num_awaiting_grammar
            or self.running
            or self._finished_for_workers
        )

    # -- scheduling ------------------------------------------------------------------

    def _pick_waiting(self) -> Request | None:
        """The next waiting request by policy; None when all wait for their grammars."""
        waiting = self.waiting
        if self.num_awaiting_grammar or (waiting and waiting[0].num_output_placeholders):
            # a request preempted while a step in flight samples for it resumes once that
            # token is known (it is sent to the workers whole)
            waiting = [
                r for r in waiting if not r.awaiting_grammar and not r.num_output_placeholders
            ]
            if not waiting:
                return None
        policy = self.config.scheduling_policy
        if policy == "priority":
            return min(waiting, key=lambda r: (r.priority, r.arrival_time))
        if policy == "lpm":
            # Longest cached prefix first (pure probe: no stats, nothing published).
            return max(waiting, key=self.kv.num_matched_prefix_tokens)
        return waiting[0]

    def _pick_victim(self) -> Request:
        if self.config.scheduling_policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]  # newest

    def _preempt(self, victim: Request) -> None:
        self.running.remove(victim)
        self.kv.free(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        if victim.num_tokens_sent_to_workers is not None:
            self._finished_for_workers.append(victim.request_id)
            victim.num_tokens_sent_to_workers = None
        self.waiting.insert(0, victim)
        self.num_preemptions += 1
        self.num_preemptions_total += 1

    def _chunk_size(self, request: Request, num_computed: int, budget: int) -> int:
        """Tokens to compute for ``request`` this step: what it still needs (placeholders
        of steps in flight counted as tokens), within the budget and the long-prefill
        threshold (0 = no threshold); 0 when a step in flight already samples what may
        be its last token."""
        if request.num_output_placeholders and self._decided_in_flight(request):
            return 0
        num_new = min(request.num_tokens_with_placeholders - num_computed, budget)
        threshold = self.config.long_prefill_token_threshold
        if 0 < threshold < num_new:
            num_new = threshold
        return num_new

    def _decided_in_flight(self, request: Request) -> bool:
        """The tokens steps in flight sample for ``request`` reach its ``max_tokens`` or
        ``max_model_len``: it ends with them whatever they are."""
        num_outputs = request.num_output_tokens + request.num_output_placeholders
        return (
            num_outputs >= request.max_tokens
            or request.num_tokens_with_placeholders >= self.max_model_len
        )

    def schedule(self) -> ScheduledStep:
        budget = self.config.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_block_ids: dict[str, list[int]] = {}
        scheduled: list[Request] = []

        # 1. Running requests: each advances by what it needs, within the budget.
        preempted_any = False
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = self._chunk_size(request, request.num_computed_tokens, budget)
            if num_new <= 0:
                i += 1
                continue
            while True:
                block_ids = self.kv.allocate_slots(request, num_new)
                if block_ids is not None:
                    break
                victim = self._pick_victim()
                if victim.request_id in num_scheduled:  # already scheduled this step: undo
                    budget += num_scheduled.pop(victim.request_id)
                    new_block_ids.pop(victim.request_id, None)
                    scheduled.remove(victim)
                    i -= 1
                self._preempt(victim)
                preempted_any = True
                if victim is request:
                    break
            if block_ids is None:
                continue  # ``request`` itself was preempted; ``i`` now points past it
            num_scheduled[request.request_id] = num_new
            new_block_ids[request.request_id] = block_ids
            scheduled.append(request)
            budget -= num_new
            i += 1

        # 2. Waiting requests, in policy order, while budget and blocks allow.
        while (
            not preempted_any
            and self.waiting
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            request = self._pick_waiting()
            if request is None:
                break  # the rest wait for their grammars
            computed_blocks, num_hit = self.kv.get_computed_blocks(request)
            num_new = self._chunk_size(request, num_hit, budget)
            num_reserved = 0
            if self.config.reserve_full_sequence:
                full = request.num_prompt_tokens + request.max_tokens
                num_reserved = max(0, full - num_hit - num_new)
            block_ids = self.kv.allocate_slots(request, num_new, computed_blocks, num_reserved)
            if block_ids is None:
                break  # peek and break: it waits for blocks to free up, never aborted
            self.kv.record_admission(request, num_hit)
            self.waiting.remove(request)
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            num_scheduled[request.request_id] = num_new
            new_block_ids[request.request_id] = block_ids
            scheduled.append(request)
            budget -= num_new

        return self._build_step(scheduled, num_scheduled, new_block_ids)

    def _build_step(
        self,
        scheduled: list[Request],
        num_scheduled: dict[str, int],
        new_block_ids: dict[str, list[int]],
    ) -> ScheduledStep:
        self._step_id += 1
        new_requests, cached_requests = [], []
        prefill_chunks = {}
        due_token_ids = set()
        requests = {}
        for request in scheduled:
            request_id = request.request_id
            requests[request_id] = request
            if request.num_computed_tokens < request.num_prompt_tokens:
                prefill_chunks[request_id] = (
                    request.num_computed_tokens,
                    num_scheduled[request_id],
                )
            if request.num_tokens_sent_to_workers is None:
                new_requests.append(
                    m.NewRequestData(
                        request_id=request_id,
                        token_ids=list(request.all_token_ids),
                        num_prompt_tokens=request.num_prompt_tokens,
                        sampling_params=request.sampling_params,
                        block_ids=self.kv.block_ids(request),
                        num_computed_tokens=request.num_computed_tokens,
                    )
                )
            else:
                cached_requests.append(
                    m.CachedRequestData(
                        request_id=request_id,
                        new_token_ids=request.all_token_ids[request.num_tokens_sent_to_workers :],
                        new_block_ids=new_block_ids[request_id],
                        num_computed_tokens=request.num_computed_tokens,
                    )
                )
            request.num_tokens_sent_to_workers = request.num_tokens
            request.num_computed_tokens += num_scheduled[request_id]
            if request.num_computed_tokens == request.num_tokens_with_placeholders:
                due_token_ids.add(request_id)
                request.num_output_placeholders += 1
        message = m.SchedulerOutput(
            step_id=self._step_id,
            new_requests=new_requests,
            cached_requests=cached_requests,
            num_scheduled_tokens=num_scheduled,
            finished_request_ids=self._finished_for_workers,
        )
        self._finished_for_workers = []
        return ScheduledStep(self._step_id, message, prefill_chunks, due_token_ids, requests)

    # -- results ---------------------------------------------------------------------

    def update_from_output(
        self, step: ScheduledStep, result: m.ModelRunnerOutput
    ) -> list[tuple[Request, m.RequestOutput]]:
        """Append sampled tokens, apply stop rules, free finished requests.

        Returns (request, output) for every request with news for its client. A request
        that was due a token (``step.due_token_ids``) and got neither a token nor an
        error ends with an error finish saying so.

        Results apply to the requests ``step`` computed, as long as they live: a request
        that ended meanwhile (aborted, or finished by the step before: async scheduling)
        has its token dropped, and one preempted meanwhile still gets it (it resumes with
        it). Each due request's placeholder is settled here, token or not.
        """
        outputs = []
        logprobs = result.logprobs
        top_logprobs = result.top_logprobs
        for request_id in step.due_token_ids:
            step.requests[request_id].num_output_placeholders -= 1
        for i, (request_id, token_id) in enumerate(
            zip(result.request_ids, result.sampled_token_ids, strict=True)
        ):
            request = self._live(step, request_id)
            if request is None:
                continue  # ended while the step ran: its token is dropped
            request.append_output_token(token_id)
            is_first_token = request.num_output_tokens == 1
            status = self._check_stop(request, token_id)
            if status is not None:
                if request.status == RequestStatus.RUNNING:
                    self.running.remove(request)
                else:  # preempted while the step ran
                    self.waiting.remove(request)
                self._free(request, status)
            output = self._output(
                request,
                [token_id],
                [logprobs[i]] if logprobs is not None else None,
                [top_logprobs[i]] if top_logprobs is not None else None,
            )
            output.embedding = result.embeddings.get(request_id)  # pooling requests
            if is_first_token and request.first_scheduled_time is not None:
                output.queue_time_s = request.first_scheduled_time - request.received_time
                output.prefill_time_s = time.monotonic() - request.first_scheduled_time
            outputs.append((request, output))
        invalid = set(result.invalid_request_ids)
        for request_id, error in result.errors.items():
            request = self._live(step, request_id)
            if request is None:
                continue
            if request_id in invalid:
                request.error = f"the requested output format cannot go on: {error}"
            else:
                request.error = f"the model failed on this request: {error}"
            self.finish_requests([request_id], RequestStatus.FINISHED_ERROR)
            output = self._output(request, [])
            if request_id in invalid:
                output.error_code = m.ErrorCode.INVALID_REQUEST
            outputs.append((request, output))
        answered = set(result.request_ids) | set(result.errors)
        for request_id in sorted(step.due_token_ids - answered):
            request = self._live(step, request_id)
            if request is None:
                continue  # ended while the step ran
            when = "its prefill completed" if request_id in step.prefill_chunks else "decoding"
            request.error = (
                f"the workers returned no token for this request in step {step.step_id} "
                f"({when}) and no error; it was ended instead of waiting forever"
            )
            logger.error("request %s: %s", request_id, request.error)
            self.finish_requests([request_id], RequestStatus.FINISHED_ERROR)
            outputs.append((request, self._output(request, [])))
        return outputs

    def _live(self, step: ScheduledStep, request_id: str) -> Request | None:
        """The request ``step`` computed as ``request_id``, if it is still live (not
        finished, and not replaced by a new request reusing the id)."""
        request = self.requests.get(request_id)
        if request is None or request is not step.requests.get(request_id):
            return None
        return None if request.status.is_finished else request

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.sampling_params
        is_stop_token = token_id in params.stop_token_ids or (
            not params.ignore_eos and token_id in self.eos_token_ids
        )
        if is_stop_token and request.num_output_tokens >= params.min_tokens:
            request.stop_token_id = token_id
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= request.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    @staticmethod
    def _output(
        request: Request,
        new_token_ids: list[int],
        new_logprobs: list[float] | None = None,
        new_top_logprobs: list[list[tuple[int, float]]] | None = None,
    ) -> m.RequestOutput:
        return m.RequestOutput(
            request_id=request.request_id,
            new_token_ids=new_token_ids,
            finish_reason=request.status.finish_reason,
            stop_token_id=request.stop_token_id,
            error=request.error,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=max(0, request.num_cached_tokens),
            new_logprobs=new_logprobs,
            new_top_logprobs=new_top_logprobs,
        )

    # -- stats -----------------------------------------------------------------------

    def make_stats(self) -> m.SchedulerStats:
        prefix = self.kv.take_stats()
        stats = m.SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.kv.usage,
            num_free_blocks=self.kv.pool.num_free_blocks,
            num_total_blocks=self.kv.pool.num_usable_blocks,
            prefix_cache_queries=prefix.queries,
            prefix_cache_hits=prefix.hits,
            num_preemptions=self.num_preemptions,
            step_id=self._step_id,
        )
        self.num_preemptions = 0
        return stats
