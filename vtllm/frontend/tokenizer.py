"""The model's tokenizer and chat template, loaded from a Hugging Face-style model dir.

Reads ``tokenizer.json`` (HF ``tokenizers``), ``tokenizer_config.json`` (chat template,
bos/eos tokens, ``add_bos_token``), an optional ``chat_template.jinja`` and
``generation_config.json`` (extra eos ids). Templates render in a Jinja2 sandbox with the
same globals and filters as ``transformers`` (``raise_exception``, ``tojson``,
``strftime_now``), so a model's own template renders as it does there. Which template is
used (``--chat-template``, a shipped replacement) and how messages are prepared for it is
``chat_template.py``.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
from tokenizers import Tokenizer

from vtllm.frontend.chat_template import (
    TemplateFeatures,
    load_chat_template,
    shipped_replacement,
    template_messages,
)

logger = logging.getLogger(__name__)


class ChatTemplateError(ValueError):
    """A chat request the template cannot render (no template, or the template refused).

    The message is meant for the HTTP client (a 400 whose ``param`` is ``param``)."""

    def __init__(self, message: str, param: str = "messages") -> None:
        super().__init__(message)
        self.param = param


def _token_content(value: Any) -> str | None:
    """tokenizer_config stores special tokens as a string or as an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _pick_chat_template(model_dir: Path, config: dict[str, Any]) -> str | None:
    """The default template: ``chat_template.jinja`` first, then tokenizer_config's
    ``chat_template`` (a string, or a list of ``{"name", "template"}`` entries)."""
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, str):
        return template
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        chosen = named.get("default") or next(iter(named.values()), None)
        return chosen if isinstance(chosen, str) else None
    return None


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators=None,
    sort_keys=False,
) -> str:
    # Same as transformers' tojson: no HTML escaping, unicode kept.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@lru_cache(maxsize=8)
def _compile_template(source: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


# Longer decodes go through ``decode_batch``, which releases the GIL (``decode`` does not).
_DECODE_RELEASING_GIL_MIN_TOKENS = 256


class ModelTokenizer:
    """Encode, decode and chat-template for one model. Thread-safe for reads.

    ``encode`` and long ``decode`` calls release the GIL (the tokenizers library's batch
    entry points), so running them on a worker thread keeps the event loop free."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        add_bos_token: bool | None = None,
        generation_eos_token_ids: Sequence[int] = (),
        chat_template_origin: str = "the model's",
    ) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        # where the template came from, for error messages
        self.chat_template_origin = chat_template_origin
        self.template_features = TemplateFeatures.of(chat_template or "")
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.add_bos_token = add_bos_token
        self.bos_token_id = tokenizer.token_to_id(bos_token) if bos_token else None
        eos_ids = list(generation_eos_token_ids)
        eos_id = tokenizer.token_to_id(eos_token) if eos_token else None
        if eos_id is not None and eos_id not in eos_ids:
            eos_ids.append(eos_id)
        # Every token id that ends generation for this model (tokenizer + generation config).
        self.eos_token_ids: list[int] = eos_ids
        # No token stands for more characters than this (its vocabulary string, plus one
        # for a leading space a decoder may add): a text of N characters has at least
        # N / max_chars_per_token tokens.
        self.max_chars_per_token = 1 + max(
            (len(t) for t in tokenizer.get_vocab(with_added_tokens=True)), default=1
        )
        self._encode_batch = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)

    @classmethod
    def from_dir(
        cls, model_dir: str | os.PathLike[str], chat_template: str | None = None
    ) -> ModelTokenizer:
        """Load from a HF-style dir. ``chat_template`` (``--chat-template``: a file or the
        template text) replaces the model's own. Raises FileNotFoundError naming the
        missing file, ValueError for a bad ``chat_template``."""
        path = Path(model_dir)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(
                f"{tokenizer_file} not found; the frontend needs a Hugging Face tokenizer.json "
                "in the model directory"
            )
        config = _read_json(path / "tokenizer_config.json")
        generation = _read_json(path / "generation_config.json")
        gen_eos = generation.get("eos_token_id")
        gen_eos_ids = [gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])
        add_bos = config.get("add_bos_token")
        template, origin = _pick_chat_template(path, config), "the model's"
        if chat_template is not None:
            template, origin = load_chat_template(chat_template), "--chat-template"
        elif template is not None and (replacement := shipped_replacement(template)):
            name, template = replacement
            origin = f"vtllm's {name}"
            logger.info(
                "the model's chat template does not render tools; using vtllm's %s instead "
                "(the same prompt without tools; --chat-template overrides)",
                name,
            )
        return cls(
            Tokenizer.from_file(str(tokenizer_file)),
            chat_template=template,
            chat_template_origin=origin,
            bos_token=_token_content(config.get("bos_token")),
            eos_token=_token_content(config.get("eos_token")),
            add_bos_token=add_bos if isinstance(add_bos, bool) else None,
            generation_eos_token_ids=[i for i in gen_eos_ids if isinstance(i, int)],
        )

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``. With ``add_special_tokens``, the tokenizer's own
        post-processor runs and a BOS is added when ``add_bos_token`` asks for one and the
        post-processor did not."""
        # the batch entry point releases the GIL while it works (single ``encode`` holds it)
        ids = self._encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        if (
            add_special_tokens
            and self.add_bos_token
            and self.bos_token_id is not None
            and (not ids or ids[0] != self.bos_token_id)
        ):
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        ids = list(token_ids)
        if len(ids) >= _DECODE_RELEASING_GIL_MIN_TOKENS:
            return self.tokenizer.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The prompt text for ``messages``. Raises ChatTemplateError (a client error) when
        the model has no template or the template refuses the conversation.

        ``continue_final_message`` leaves the last (assistant) message open so the model
        continues it: the text is cut right after that message's content."""
        if self.chat_template is None:
            raise ChatTemplateError(
                "this model has no chat template (tokenizer_config.json has no chat_template); "
                "use /v1/completions with a plain prompt instead"
            )
        if continue_final_message and add_generation_prompt:
            raise ChatTemplateError(
                "continue_final_message and add_generation_prompt cannot both be true"
            )
        self._check_renders_tools(messages, tools)
        messages = template_messages(messages)
        context: dict[str, Any] = dict(chat_template_kwargs or {})
        context.update(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )
        try:
            text = _compile_template(self.chat_template).render(**context)
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(f"chat template error: {e}") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            # e.g. a message without content where the template concatenates strings
            raise ChatTemplateError(
                f"the chat template could not render these messages: {e!r}"
            ) from None
        if continue_final_message:
            text = _cut_after_final_message(text, messages)
        return text

    def _check_renders_tools(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> None:
        """Refuse tools or tool calls the template would silently leave out."""
        features = self.template_features
        if tools and not features.renders_tools:
            missing, param = "`tools`", "tools"
        elif not features.renders_tool_calls and any(m.get("tool_calls") for m in messages):
            missing, param = "assistant `tool_calls`", "messages"
        else:
            return
        raise ChatTemplateError(
            f"the chat template ({self.chat_template_origin}) does not render {missing}, so "
            "the model would never see them; start the server with --chat-template FILE (a "
            "template that renders tools, e.g. one of vtllm/frontend/chat_templates/), or "
            "send the request without them",
            param,
        )


def _cut_after_final_message(text: str, messages: list[dict[str, Any]]) -> str:
    final = messages[-1].get("content") if messages else None
    if not isinstance(final, str) or not final:
        raise ChatTemplateError("continue_final_message needs a final message with text content")
    end = text.rfind(final.strip())
    if end < 0:
        raise ChatTemplateError(
            "continue_final_message: the chat template did not render the final message verbatim"
        )
    return text[: end + len(final.strip())]
