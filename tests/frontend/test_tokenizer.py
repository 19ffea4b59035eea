"""Tokenizer loading and chat templates, against a real trained BPE tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.frontend.conftest import write_model_dir
from vtllm.frontend.tokenizer import ChatTemplateError, ModelTokenizer


def test_chatml_template_renders(tokenizer: ModelTokenizer) -> None:
    text = tokenizer.render_chat(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    )
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHello<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_prompt = tokenizer.render_chat(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=False
    )
    assert no_prompt == "<|im_start|>user\nHi<|im_end|>\n"


def test_special_tokens_encode_as_single_ids(tokenizer: ModelTokenizer) -> None:
    ids = tokenizer.encode("<|im_start|>user\nHi<|im_end|>", add_special_tokens=False)
    assert ids[0] == tokenizer.tokenizer.token_to_id("<|im_start|>")
    assert ids[-1] == tokenizer.tokenizer.token_to_id("<|im_end|>")
    assert tokenizer.decode(ids) == "user\nHi"  # special tokens skipped


def test_eos_ids_from_tokenizer_config_and_generation_config(tokenizer: ModelTokenizer) -> None:
    # generation_config eos 0 (<|endoftext|>) and tokenizer_config eos <|im_end|> (an
    # AddedToken dict)
    assert tokenizer.eos_token == "<|im_end|>"
    assert sorted(tokenizer.eos_token_ids) == [0, 2]


def test_missing_template_is_a_client_error(tmp_path: Path) -> None:
    tok = ModelTokenizer.from_dir(write_model_dir(tmp_path, chat_template=None))
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.render_chat([{"role": "user", "content": "hi"}])


def test_template_globals_and_kwargs(tmp_path: Path) -> None:
    template = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}"
        "{{ bos_token }}{{ tools | tojson }}|{{ flavor }}|{{ strftime_now('%Y') | length }}"
    )
    tok = ModelTokenizer.from_dir(write_model_dir(tmp_path, chat_template=template))
    text = tok.render_chat(
        [{"role": "user", "content": "x"}],
        tools=[{"name": "f", "d": "é"}],
        chat_template_kwargs={"flavor": "mint"},
    )
    assert text == '[{"name": "f", "d": "é"}]|mint|4'
    with pytest.raises(ChatTemplateError, match="user first"):
        tok.render_chat([{"role": "system", "content": "x"}])


def test_continue_final_message(tokenizer: ModelTokenizer) -> None:
    text = tokenizer.render_chat(
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Once upon"}],
        add_generation_prompt=False,
        continue_final_message=True,
    )
    assert text.endswith("<|im_start|>assistant\nOnce upon")


def test_template_list_form_and_jinja_file(tmp_path: Path) -> None:
    path = write_model_dir(tmp_path / "a", chat_template=None)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "tool_use", "template": "TOOLS"},
        {"name": "default", "template": "DEFAULT"},
    ]
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    assert ModelTokenizer.from_dir(path).render_chat([{"role": "user", "content": ""}]) == "DEFAULT"
    (path / "chat_template.jinja").write_text("FILE")
    assert ModelTokenizer.from_dir(path).render_chat([{"role": "user", "content": ""}]) == "FILE"


def test_missing_tokenizer_json_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        ModelTokenizer.from_dir(tmp_path)
