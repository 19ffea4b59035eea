"""Every message that crosses a process boundary in vtllm.

Two channels, each with its own tagged union (msgpack arrays whose first element is the
tag, so a peer can tell kinds apart and reject the unknown):

* client ⇄ engine core (ZMQ DEALER ⇄ ROUTER):
  client → engine: ``Hello``, ``AddRequest``, ``AbortRequests``, ``UtilityRequest``,
  ``Heartbeat``, ``Goodbye``;
  engine → client: ``Ready``, ``HandshakeRefused``, ``EngineOutputs``, ``UtilityResponse``,
  ``Heartbeat``, ``EngineDead``, ``SessionUnknown``.
* engine core ⇄ workers (ZMQ ROUTER ⇄ DEALER, identity ``rank-N``):
  worker → engine: ``WorkerReport`` (start-up: model facts and usable KV bytes),
  ``WorkerReady``, ``ModelRunnerOutput`` (rank 0 only), ``WorkerFailure``,
  ``WorkerHeartbeat`` (from a thread of each worker, on a socket of its own);
  engine → worker: ``InitKVCache``, ``SchedulerOutput``, ``Shutdown``.

Wire compatibility: new fields are appended at the end with a default, so an older peer's
shorter arrays still decode; anything else bumps ``PROTOCOL_VERSION``.
"""

from __future__ import annotations

import enum

import msgspec

PROTOCOL_VERSION = 1


class _Message(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    """Base of every top-level message: encoded as ``[tag, field, field, ...]``."""


class _Part(msgspec.Struct, array_like=True, omit_defaults=True):
    """Base of the structs nested inside messages (no tag)."""


class FinishReason(enum.IntEnum):
    """Why a request ended. Sent as an int on the wire."""

    STOP = 0  # a stop token (EOS or stop_token_ids) was sampled
    LENGTH = 1  # max_tokens reached, or max_model_len reached
    ABORT = 2  # aborted by its client (or its client went away)
    ERROR = 3  # refused or failed; ``RequestOutput.error`` says why

    @property
    def openai_name(self) -> str:
        return ("stop", "length", "abort", "error")[self]


class ErrorCode(enum.IntEnum):
    """What kind of failure a ``FinishReason.ERROR`` is (``RequestOutput.error_code``), so
    a frontend can answer as HTTP would: 400, 503 or 500."""

    INVALID_REQUEST = 0  # the request breaks a rule (``error_param`` names the field)
    UNAVAILABLE = 1  # the engine cannot serve it now (stopping, workers lost): retry elsewhere
    INTERNAL = 2  # the engine or the model failed on it


# ---------------------------------------------------------------------------------------
# Shared parts


class StructuredOutputKind(enum.IntEnum):
    """What a ``StructuredOutputSpec.spec`` holds. Sent as an int on the wire."""

    JSON_OBJECT = 0  # any JSON object; ``spec`` is unused
    JSON_SCHEMA = 1  # a JSON schema, as JSON text
    REGEX = 2  # a regular expression the whole output matches
    CHOICE = 3  # a JSON array of strings: the output is exactly one of them
    GRAMMAR = 4  # an EBNF grammar (xgrammar/GBNF syntax) whose start rule is ``root``


class PoolingType(enum.IntEnum):
    """Embedding requests (``/v1/embeddings``): which final hidden states the worker pools
    into the request's ``RequestOutput.embedding``. Sent as an int on the wire."""

    NONE = 0  # a generation request
    LAST = 1  # the last prompt token's final hidden state
    MEAN = 2  # the mean over every prompt token (needs the whole prompt computed)


class StructuredOutputSpec(_Part):
    """Constrains the output to a format: before each sampled token, the worker masks
    every token the format's grammar does not allow (``vtllm/worker/grammar.py``); EOS
    and stop tokens are allowed only where the grammar may end. The size of ``spec`` is
    bounded by ``limits.MAX_STRUCTURED_OUTPUT_CHARS``.

    ``start_after_token_id``: enforcement starts after the first output token equal to
    it (a reasoning model's end-of-thinking token such as ``</think>``: the thinking
    stays free, the answer follows the format); None = from the first output token.
    """

    kind: StructuredOutputKind
    spec: str = ""
    start_after_token_id: int | None = None


class SamplingParams(_Part):
    """How to pick each next token. The bounds of every field are in
    ``protocol/limits.py`` (``SAMPLING_RANGES``): the frontend's request schema is built
    from them and the engine core checks every request against them again (clients may
    bypass the frontend).

    ``max_tokens`` None means unset: the engine core resolves it to
    ``max_model_len - num_prompt_tokens``.
    """

    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # 1 = off
    top_k: int = 0  # 0 = off
    min_p: float = 0.0  # 0 = off
    seed: int | None = None  # per-request generator; None = engine's shared generator
    max_tokens: int | None = None
    min_tokens: int = 0
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # None = none; 0 = chosen token only; N = plus top-N
    logit_bias: dict[int, float] = {}  # token id → added to its logit before sampling
    structured_output: StructuredOutputSpec | None = None  # None = free text
    pooling: PoolingType = PoolingType.NONE  # embeddings: pool the prompt's hidden states


class SchedulerStats(_Part):
    """A snapshot of the engine core, attached to outputs at most once per step."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of usable blocks in use, 0..1
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    prefix_cache_queries: int = 0  # tokens queried since the previous stats (delta)
    prefix_cache_hits: int = 0  # tokens hit since the previous stats (delta)
    num_preemptions: int = 0  # preemptions since the previous stats (delta)
    step_id: int = 0


# ---------------------------------------------------------------------------------------
# Client ⇄ engine core


class Hello(_Message, tag="hello"):
    """Opens a session. ``session_id`` (new for each session a client opens) makes a
    repeated Hello idempotent: the same id gets the same session back; a new id from a
    known client ends its old session first (the engine aborts that session's requests)."""

    protocol_version: int
    client_name: str
    session_id: str = ""


class Ready(_Message, tag="ready"):
    """The engine core's answer to ``Hello`` once its workers are up."""

    protocol_version: int
    model: str
    max_model_len: int
    vocab_size: int
    num_kv_blocks: int
    block_size: int
    eos_token_ids: list[int]
    engine_id: str = ""
    # the longest message this engine core reads (bytes; 0 = not said): a client checks
    # its frames against it before sending (longer ones are refused or cut off)
    max_frame_bytes: int = 0


class HandshakeRefused(_Message, tag="refused"):
    reason: str


class AddRequest(_Message, tag="add"):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = 0.0
    priority: int = 0  # lower value = served first under --scheduling-policy priority
    cache_salt: str | None = None


class AbortRequests(_Message, tag="abort"):
    request_ids: list[str]


class UtilityRequest(_Message, tag="util"):
    """A named call into the engine core (``reset_prefix_cache``, ``get_stats``, ...)."""

    call_id: int
    method: str
    args: list[msgspec.Raw] = []


class UtilityResponse(_Message, tag="util_result"):
    call_id: int
    ok: bool
    result: msgspec.Raw = msgspec.Raw(b"\xc0")  # msgpack nil
    error: str | None = None


class Heartbeat(_Message, tag="hb"):
    timestamp: float


class Goodbye(_Message, tag="bye"):
    """A client leaving: the engine core aborts every request it still owns."""


class RequestOutput(_Part):
    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None  # the stop token that ended it, if any
    error: str | None = None  # set with FinishReason.ERROR
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # logprob of each new token, and (if asked) the top-N (token id, logprob) pairs
    new_logprobs: list[float] | None = None
    new_top_logprobs: list[list[tuple[int, float]]] | None = None
    # Engine-side timings, on the output that carries a request's first token: seconds
    # from the engine receiving it to its first scheduling, and from then to that token.
    queue_time_s: float | None = None
    prefill_time_s: float | None = None
    # with FinishReason.ERROR: what kind of failure, and the request field at fault
    error_code: ErrorCode | None = None
    error_param: str | None = None
    # The refusal of an AddRequest that reused the id of the sender's own live request:
    # it answers only that add; the live request is untouched and goes on (its own
    # outputs never carry this flag). A client must not route it to the live request.
    duplicate_id: bool = False
    # a pooling request's pooled hidden state (SamplingParams.pooling), on its first output
    embedding: list[float] | None = None


class EngineOutputs(_Message, tag="outputs"):
    outputs: list[RequestOutput]
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0


class EngineDead(_Message, tag="dead"):
    """The engine core is going down because of a failure; every request is lost."""

    reason: str


class SessionUnknown(_Message, tag="no_session"):
    """The engine core's answer to any message (but ``Hello`` and ``Goodbye``) from a client
    it has no session with: it was dropped after falling silent, or the engine restarted.
    Its requests are gone (aborted); the client must say ``Hello`` again."""

    reason: str


ClientToEngine = Hello | AddRequest | AbortRequests | UtilityRequest | Heartbeat | Goodbye
EngineToClient = (
    Ready
    | HandshakeRefused
    | EngineOutputs
    | UtilityResponse
    | Heartbeat
    | EngineDead
    | SessionUnknown
)


# ---------------------------------------------------------------------------------------
# Engine core ⇄ workers


class ModelFacts(_Part):
    """What the engine core needs to know of the model, reported by rank 0."""

    model_name: str
    vocab_size: int
    max_position_embeddings: int  # the model's own context limit
    eos_token_ids: list[int]
    num_layers: int
    kv_bytes_per_token: int  # all layers, K and V, on one rank


class WorkerReport(_Message, tag="report"):
    """Start-up: the model is loaded and memory profiled."""

    rank: int
    facts: ModelFacts
    usable_kv_bytes: int  # bytes this rank can give to its KV cache
    on_gpu: bool = False  # the rank computes on a GPU (unset --async-scheduling: on)


class InitKVCache(_Message, tag="init_kv"):
    num_blocks: int
    block_size: int


class WorkerReady(_Message, tag="worker_ready"):
    rank: int


class NewRequestData(_Part):
    """A request the worker has not seen (or sees again after preemption): everything."""

    request_id: str
    token_ids: list[int]  # prompt, plus outputs so far when resumed after preemption
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int  # tokens whose KV is already in the cache (prefix hit)


class CachedRequestData(_Part):
    """A request the worker already holds: only what changed since the last step."""

    request_id: str
    new_token_ids: list[int]  # tokens appended since last scheduled (sampled tokens)
    new_block_ids: list[int]  # blocks appended to its block table
    num_computed_tokens: int


class SchedulerOutput(_Message, tag="step"):
    """One step's work, broadcast to every rank.

    For each request, ``num_scheduled_tokens[request_id]`` tokens starting at its
    ``num_computed_tokens`` are computed this step. A request whose computed tokens then
    reach the end of its known tokens gets one sampled token.

    Async scheduling: the tokens scheduled may end one position past the tokens the worker
    has been sent; the token there is the one the step just before sampled for the request
    (the worker feeds it from the device; the engine sends it in a later step's
    ``new_token_ids``).
    """

    step_id: int
    new_requests: list[NewRequestData]
    cached_requests: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]
    # finished, aborted or preempted since the last step: the worker drops their state
    finished_request_ids: list[str] = []


class ModelRunnerOutput(_Message, tag="step_result"):
    """Rank 0's answer to a ``SchedulerOutput``: one sampled token per request that
    reached the end of its known tokens, in ``request_ids`` order."""

    step_id: int
    request_ids: list[str]
    sampled_token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # per-request failures (the request ends with FinishReason.ERROR, the rest go on)
    errors: dict[str, str] = {}
    # pooling requests whose prompt completed this step: the pooled final hidden state
    embeddings: dict[str, list[float]] = {}
    # the ids in ``errors`` that failed on their own input (an output format that this
    # vocabulary cannot continue): INVALID_REQUEST, HTTP 400, not a model failure
    invalid_request_ids: list[str] = []


class WorkerFailure(_Message, tag="worker_failure"):
    rank: int
    message: str


class WorkerHeartbeat(_Message, tag="worker_beat"):
    """Sent about once a second by a thread of each worker (its own socket), whatever
    the main thread is doing: silence means the process is frozen or gone, not busy.
    ``phase`` names what the main thread is doing (start-up phase or "serving")."""

    rank: int
    phase: str
    phase_elapsed_s: float = 0.0


class Shutdown(_Message, tag="shutdown"):
    pass


class CompileGrammar(_Message, tag="compile_grammar"):
    """To rank 0 (the driver, which owns grammar state) when a request with a structured
    output is admitted, outside any step: compile ``spec`` for ``request_id`` on a
    background thread and answer ``GrammarReady`` with the same ``seq``. The worker holds
    the compiled grammar for the request (across preemption) until ``ReleaseGrammars``
    names it."""

    request_id: str
    seq: int  # engine-core counter: tells a stale answer (an id reused) from this one
    spec: StructuredOutputSpec


class ReleaseGrammars(_Message, tag="release_grammars"):
    """To rank 0: these requests finished (any way) or were aborted; forget their
    grammars (compiled, compiling, or matching)."""

    request_ids: list[str]


class GrammarReady(_Message, tag="grammar_ready"):
    """Rank 0's answer to ``CompileGrammar``, sent whenever the compile ends (between
    steps, or after a step's output): ``error`` None = compiled, the request may be
    scheduled; otherwise xgrammar's reason (the request ends as INVALID_REQUEST)."""

    request_id: str
    seq: int
    error: str | None = None


WorkerToEngine = (
    WorkerReport | WorkerReady | ModelRunnerOutput | WorkerFailure | WorkerHeartbeat | GrammarReady
)
EngineToWorker = InitKVCache | SchedulerOutput | CompileGrammar | ReleaseGrammars | Shutdown
