"""Grammar state of structured outputs, held by the driver rank (the one that samples).

Why here: xgrammar imports torch (its bitmask API is torch tensors), so the engine core
and the frontend (no torch, by the import-boundary test) cannot hold it; the driver
worker samples, so it learns each token first and needs no extra round trip to advance a
matcher, and the bitmask is filled next to the device it is applied on.

Per request (keyed by request id)::

    spec ─ compile (background thread, cached by (kind, spec)) ─ CompiledGrammar
         ─ GrammarMatcher ─ accepts the request's output tokens as the engine reports them
         ─ fill_next_token_bitmask before each of its samples

The matcher advances over ``token_ids[num_prompt_tokens:]`` — the tokens the engine core
has accepted — never over what was merely sampled, so an output the engine drops, a
request resumed after preemption (it comes back as a new request with its outputs, and a
fresh matcher replays them) or an abort (``retain`` forgets it) cannot desynchronise it.

Compilation never runs on the step's thread, and never holds a step: the engine core
sends ``CompileGrammar`` when it admits the request (``prepare``), schedules it only after
the ``GrammarReady`` this side reports once the compile ends (``take_ready``), and sends
``ReleaseGrammars`` when it finishes (``release``). The compiled grammar is held per
request from ``prepare`` to ``release``, so a preempted request resumes without a
recompile. A request that reaches a step without ``prepare`` (a direct ``ModelRunner``
user) compiles at its first sample and waits for it, at most ``max_wait_s`` (its peers in
that step wait with it).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Container, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vtllm import envs
from vtllm.protocol.messages import StructuredOutputKind, StructuredOutputSpec

logger = logging.getLogger(__name__)

MAX_CACHED_GRAMMARS = 256  # compiled grammars kept, least recently used dropped first


class GrammarError(ValueError):
    """A spec xgrammar cannot compile, or a token its grammar refused; for the client."""


def load_tokenizer_info(tokenizer_dir: str | Path, vocab_size: int, eos_token_ids: Sequence[int]):
    """xgrammar's view of the tokenizer in ``tokenizer_dir/tokenizer.json``: every token's
    bytes, for a mask ``vocab_size`` wide (the model's logits, which may be wider than the
    tokenizer), with the model's EOS ids as the tokens allowed where the grammar ends."""
    import xgrammar
    from transformers import PreTrainedTokenizerFast

    tokenizer_file = Path(tokenizer_dir) / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise GrammarError(f"structured outputs need {tokenizer_file}, which is missing")
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_file))
    return xgrammar.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=vocab_size, stop_token_ids=list(eos_token_ids) or None
    )


def choice_grammar(choices: list[str]) -> str:
    """EBNF whose language is exactly ``choices`` (JSON string escapes are EBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def compile_spec(compiler: Any, spec: StructuredOutputSpec) -> Any:
    """``spec`` compiled by an ``xgrammar.GrammarCompiler``; GrammarError naming the
    problem when it does not compile. JSON comes out compact (no free whitespace), so a
    model cannot spend its whole budget on spaces between tokens."""
    kind = spec.kind
    try:
        if kind == StructuredOutputKind.JSON_OBJECT:
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if kind == StructuredOutputKind.JSON_SCHEMA:
            return compiler.compile_json_schema(spec.spec, any_whitespace=False)
        if kind == StructuredOutputKind.REGEX:
            return compiler.compile_regex(spec.spec)
        if kind == StructuredOutputKind.CHOICE:
            return compiler.compile_grammar(choice_grammar(json.loads(spec.spec)))
        if kind == StructuredOutputKind.GRAMMAR:
            return compiler.compile_grammar(spec.spec)
    except (RuntimeError, ValueError, TypeError) as exc:
        # xgrammar's messages start with "[time] /path/file.cc:line: "; keep the reason
        reason = str(exc).strip().split(": ", 1)[-1] if ".cc:" in str(exc) else str(exc)
        raise GrammarError(f"invalid {kind.name.lower()}: {reason}") from exc
    raise GrammarError(f"unknown structured output kind {int(kind)}")


class GrammarCompilerService:
    """Compiles specs on background threads; one future per distinct (kind, spec), kept
    for the ``MAX_CACHED_GRAMMARS`` most recently used. xgrammar (with torch and
    transformers) is imported on the first compile, on a background thread too."""

    def __init__(
        self,
        tokenizer_dir: str | Path,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        tokenizer_info: Any = None,
    ) -> None:
        self.vocab_size = vocab_size  # the width of every bitmask
        self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar")
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[int, str], Future] = OrderedDict()
        self._compiler: Future = self._executor.submit(
            self._make_compiler, tokenizer_dir, vocab_size, list(eos_token_ids), tokenizer_info
        )

    @staticmethod
    def _make_compiler(tokenizer_dir, vocab_size, eos_token_ids, tokenizer_info) -> Any:
        import xgrammar

        if tokenizer_info is None:
            tokenizer_info = load_tokenizer_info(tokenizer_dir, vocab_size, eos_token_ids)
        return xgrammar.GrammarCompiler(tokenizer_info, max_threads=2)

    def compile(self, spec: StructuredOutputSpec) -> Future:
        """A future of the compiled grammar (shared by every request with this spec)."""
        key = (int(spec.kind), spec.spec)
        with self._lock:
            future = self._cache.get(key)
            if future is None or (future.done() and future.exception() is not None):
                future = self._executor.submit(self._compile, spec)
                self._cache[key] = future
            self._cache.move_to_end(key)
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return future

    def _compile(self, spec: StructuredOutputSpec) -> Any:
        started = time.monotonic()
        delay = envs.VT_TEST_GRAMMAR_COMPILE_DELAY_S
        if delay > 0:
            time.sleep(delay)
        compiled = compile_spec(self._compiler.result(), spec)
        logger.debug("compiled %s grammar in %.3fs", spec.kind.name, time.monotonic() - started)
        return compiled

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


@dataclass
class _RequestGrammar:
    spec: StructuredOutputSpec
    compiled: Future
    matcher: Any = None  # xgrammar.GrammarMatcher once compiled
    num_seen: int = 0  # output tokens looked at so far
    enforcing: bool = False  # False until ``start_after_token_id`` has been output


class GrammarBitmask:
    """The grammars of one step's sampling rows, as xgrammar's packed bitmask::

    bitmask [num_masked, ceil(vocab / 32)] int32: bit (t % 32) of word t // 32 is 1
    when token t is allowed (little-endian bits, as xgrammar packs them)
    rows    [num_masked] the batch rows they belong to
    """

    def __init__(self, rows: list[int], bitmask: torch.Tensor) -> None:
        self.rows = rows
        self.bitmask = bitmask


class StructuredOutputs:
    """Every live request's grammar on the driver rank."""

    def __init__(self, compilers: GrammarCompilerService, max_wait_s: float = 60.0) -> None:
        self.compilers = compilers
        self.max_wait_s = max_wait_s
        self._grammars: dict[str, _RequestGrammar] = {}
        self._held: dict[str, Future] = {}  # prepared, not released: request id → compile
        self._unreported: dict[str, tuple[int, Future]] = {}  # request id → (seq, compile)
        self._bitmask: torch.Tensor | None = None  # host buffer, grown on demand

    def __len__(self) -> int:
        return len(self._grammars)

    def num_held(self) -> int:
        """Requests with any state here (matcher, held compile or pending report)."""
        return len(set(self._grammars) | set(self._held) | set(self._unreported))

    def prepare(self, request_id: str, seq: int, spec: StructuredOutputSpec) -> None:
        """Start compiling ``spec`` for a request the engine core just admitted; held
        for it until ``release``, reported once by ``take_ready``."""
        future = self.compilers.compile(spec)
        self._held[request_id] = future
        self._unreported[request_id] = (seq, future)

    def release(self, request_ids: Sequence[str]) -> None:
        """Forget finished or aborted requests: held compiles, pending reports, matchers
        (a compile still running finishes into the shared cache and is not reported)."""
        for request_id in request_ids:
            self._held.pop(request_id, None)
            self._unreported.pop(request_id, None)
            self._grammars.pop(request_id, None)

    @property
    def has_unreported(self) -> bool:
        return bool(self._unreported)

    def take_ready(self) -> list[tuple[str, int, str | None]]:
        """``(request id, seq, error or None)`` of every prepared compile that ended
        since the last call (each reported once)."""
        ready = []
        for request_id, (seq, future) in list(self._unreported.items()):
            if future.done():
                del self._unreported[request_id]
                ready.append((request_id, seq, _compile_error(future)))
        return ready

    def add(self, request_id: str, spec: StructuredOutputSpec) -> None:
        """A fresh matcher for a (new or resumed) request, over its held compile (or a
        compile started now, for a request never prepared)."""
        compiled = self._held.get(request_id) or self.compilers.compile(spec)
        self._grammars[request_id] = _RequestGrammar(spec, compiled)

    def retain(self, live_request_ids: Container[str]) -> None:
        """Forget every request not in ``live_request_ids`` (finished, aborted, preempted)."""
        for request_id in [r for r in self._grammars if r not in live_request_ids]:
            del self._grammars[request_id]

    def bitmask(
        self, rows: Sequence[tuple[str, list[int], int]]
    ) -> tuple[GrammarBitmask | None, dict[str, str]]:
        """The bitmask of the rows ``(request_id, token_ids, num_prompt_tokens)`` that are
        under a grammar now, after advancing each matcher over its new output tokens; and
        ``{request id: error}`` for rows that cannot go on (their rows stay unmasked and
        the caller drops them)."""
        masked: list[tuple[int, _RequestGrammar]] = []
        errors: dict[str, str] = {}
        for row, (request_id, token_ids, num_prompt_tokens) in enumerate(rows):
            grammar = self._grammars.get(request_id)
            if grammar is None:
                continue
            try:
                if self._advance(grammar, token_ids[num_prompt_tokens:]):
                    masked.append((row, grammar))
            except GrammarError as exc:
                errors[request_id] = str(exc)
                del self._grammars[request_id]
        if not masked:
            return None, errors
        buffer = self._buffer(len(masked))
        for i, (_, grammar) in enumerate(masked):
            grammar.matcher.fill_next_token_bitmask(buffer, i)
        bitmask = buffer[: len(masked)]  # [rows, ceil(vocab / 32)] int32, on the host
        allows_any = bitmask.ne(0).any(dim=1).tolist()
        if not all(allows_any):  # a dead end: sampling would draw a token it refuses
            for i, (_, grammar) in enumerate(masked):
                if not allows_any[i]:
                    request_id = rows[masked[i][0]][0]
                    errors[request_id] = (
                        f"after {grammar.num_seen} output tokens the format allows no "
                        "token of this model's vocabulary (it asks for text this tokenizer "
                        "cannot produce); simplify the regex, schema or grammar"
                    )
                    del self._grammars[request_id]
            masked = [pair for i, pair in enumerate(masked) if allows_any[i]]
            bitmask = bitmask[torch.tensor(allows_any)]
            if not masked:
                return None, errors
        return GrammarBitmask([row for row, _ in masked], bitmask), errors

    def _advance(self, grammar: _RequestGrammar, outputs: list[int]) -> bool:
        """Feed the outputs not seen yet; True when the next token is under the grammar."""
        if grammar.matcher is None:
            grammar.matcher = self._matcher(grammar)
        start = grammar.spec.start_after_token_id
        for token_id in outputs[grammar.num_seen :]:
            grammar.num_seen += 1
            if not grammar.enforcing:
                grammar.enforcing = start is None or token_id == start
                if start is not None:
                    continue  # the end-of-thinking token itself is not the grammar's
            if grammar.matcher.is_terminated():
                continue  # EOS was accepted (ignore_eos goes on): nothing left to enforce
            if not grammar.matcher.accept_token(token_id):
                raise GrammarError(f"the grammar refused the output token {token_id}")
        grammar.enforcing = grammar.enforcing or start is None
        return grammar.enforcing and not grammar.matcher.is_terminated()

    def _matcher(self, grammar: _RequestGrammar) -> Any:
        import xgrammar

        try:
            compiled = grammar.compiled.result(timeout=self.max_wait_s)
        except FutureTimeout:
            raise GrammarError(
                f"the grammar was not compiled within {self.max_wait_s:g} s; send a simpler "
                "schema or grammar"
            ) from None
        except GrammarError:
            raise
        except Exception as exc:  # tokenizer missing, xgrammar absent, ...
            raise GrammarError(f"structured outputs are unavailable: {exc}") from exc
        return xgrammar.GrammarMatcher(compiled)

    def _buffer(self, num_rows: int) -> torch.Tensor:
        import xgrammar

        if self._bitmask is None or self._bitmask.shape[0] < num_rows:
            vocab_size = self.compilers.vocab_size
            self._bitmask = xgrammar.allocate_token_bitmask(max(8, num_rows), vocab_size)
        return self._bitmask


def _compile_error(future: Future) -> str | None:
    """None for a compile that succeeded; else the reason, for the client."""
    exc = future.exception()
    if exc is None:
        return None
    if isinstance(exc, GrammarError):
        return str(exc)
    return f"structured outputs are unavailable: {exc}"
