"""A reasoning model's thinking, split from its answer: ``<think>…</think>`` → the
message's ``reasoning_content``, the rest → ``content`` (and to the tool-call parser).

One parser per choice, fed the text as it streams (``push``) and told when it ends
(``finish``); each returns the ``(reasoning, content)`` text it made final. Tags split over
several pushes are held back until they are whole, so a stream never shows half a tag.

* ``qwen3``: thinking only when it is opened: the output starts with ``<think>``, or the
  prompt ends inside an open ``<think>`` (templates that start the thinking for the model,
  as Qwen3's thinking-only models do). Otherwise the whole output is content
  (``enable_thinking: false``).
* ``deepseek_r1``: the output starts thinking (DeepSeek-R1's template ends the prompt with
  ``<think>\\n``); a leading ``<think>`` is dropped.

Thinking that never closes (the output ran out of tokens) is all reasoning.
"""

from __future__ import annotations

from vtllm.frontend.tool_parsers import partial_prefix_len

THINK_START = "<think>"
THINK_END = "</think>"
REASONING_PARSERS = ("qwen3", "deepseek_r1")


def prompt_opens_thinking(prompt_text: str) -> bool:
    """Whether the rendered prompt ends inside an unclosed ``<think>``."""
    return prompt_text.rfind(THINK_START) > prompt_text.rfind(THINK_END)


def expects_thinking(name: str, prompt_text: str) -> bool:
    """Whether the output is expected to start with thinking, so that an output format
    applies only after ``</think>``: always for deepseek_r1; for qwen3 unless the prompt
    ends with a closed (empty) thinking block, as Qwen3's template writes for
    ``enable_thinking: false``."""
    if name == "deepseek_r1" or prompt_opens_thinking(prompt_text):
        return True
    return not prompt_text.rstrip().endswith(THINK_END)


class ReasoningParser:
    """``push``/``finish`` → ``(reasoning, content)``; see the module docstring."""

    def __init__(self, name: str, prompt_text: str = "") -> None:
        if name not in REASONING_PARSERS:
            raise ValueError(
                f"unknown reasoning parser {name!r}; choose one of {list(REASONING_PARSERS)}"
            )
        starts_thinking = name == "deepseek_r1" or prompt_opens_thinking(prompt_text)
        # "start": a leading <think> may come; "thinking"; "answer": all is content
        self._state = "start"
        self._thinking_if_no_tag = starts_thinking
        self._buffer = ""
        self._after_end = False  # strip the whitespace right after </think>

    def push(self, text: str) -> tuple[str, str]:
        self._buffer += text
        return self._advance(final=False)

    def finish(self) -> tuple[str, str]:
        return self._advance(final=True)

    def _advance(self, final: bool) -> tuple[str, str]:
        reasoning = content = ""
        while True:
            if self._state == "start":
                stripped = self._buffer.lstrip()
                if not final and THINK_START.startswith(stripped):
                    return reasoning, content  # may still become <think>
                if stripped.startswith(THINK_START):
                    self._buffer = stripped[len(THINK_START) :].lstrip()
                    self._state = "thinking"
                else:
                    self._state = "thinking" if self._thinking_if_no_tag else "answer"
            if self._state == "thinking":
                end_idx = self._buffer.find(THINK_END)
                if end_idx < 0:
                    keep = 0 if final else partial_prefix_len(self._buffer, THINK_END)
                    end = len(self._buffer) - keep
                    reasoning += self._buffer[:end]
                    self._buffer = self._buffer[end:]
                    return reasoning, content
                reasoning += self._buffer[:end_idx]
                self._buffer = self._buffer[end_idx + len(THINK_END) :]
                self._state = "answer"
                self._after_end = True
            # self._state == "answer"
            if self._after_end:
                self._buffer = self._buffer.lstrip()
                if not self._buffer and not final:
                    return reasoning, content
                self._after_end = False
            content += self._buffer
            self._buffer = ""
            return reasoning, content
