"""GGUF -> Hugging Face directory conversion, checked against transformers' own GGUF loader.

transformers dequantizes the GGUF, un-permutes q/k and builds a tokenizer from the metadata by
itself, so it is an independent reference for every file the converter writes. The embedded
SmolLM2 GGUF is converted once per module.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import gguf
import jinja2
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from tests.gguf_reference import ReaderKey, reading_each_gguf_once
from vtllm.worker.loader import gguf_convert
from vtllm.worker.loader.gguf_convert import (
    find_embedded_gguf,
    float32_to_bfloat16_bits,
    resolve_model_dir,
)

TOKENIZER_SAMPLES = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "12345",
    "pi is 3.14 and e is 2.71828; 1,000,000 and 0.5%",
    "year 2024-12-31T23:59:59Z",
    "naïve café résumé",
    "Здравствуй, мир",
    "你好，世界。日本語のテキスト",
    "emoji 😀👍🏽 and 🇫🇷 flags",
    "   leading spaces",
    "trailing spaces   ",
    "tabs\tand\t\ttabs",
    "line one\nline two\n\n\nline five\r\n",
    "def f(x):\n    return x ** 2  # square\n",
    "don't won't it's we're I'll they've",
    "<|im_start|>user\nHi<|im_end|>",
    "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text after<repo_name>",
    "",
]


@pytest.fixture(scope="module")
def embedded_gguf() -> Path:
    return find_embedded_gguf()


@pytest.fixture(scope="module")
def conversion(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[str], float]:
    """(cache_dir, converted model dir, progress lines, seconds) for the embedded model."""
    cache_dir = tmp_path_factory.mktemp("vt_cache")
    progress_lines: list[str] = []
    started = time.monotonic()
    model_dir = resolve_model_dir(None, cache_dir, progress_lines.append)
    return cache_dir, model_dir, progress_lines, time.monotonic() - started


@pytest.fixture(scope="module")
def model_dir(conversion: tuple[Path, Path, list[str], float]) -> Path:
    return conversion[1]


@pytest.fixture(scope="module")
def gguf_readers() -> dict[ReaderKey, Any]:
    """transformers' readers of the embedded GGUF, shared by its references (one parse)."""
    return {}


@pytest.fixture(scope="module")
def reference_tokenizer(embedded_gguf: Path, gguf_readers: dict[ReaderKey, Any]):
    from transformers import AutoTokenizer

    with reading_each_gguf_once(gguf_readers):
        return AutoTokenizer.from_pretrained(embedded_gguf.parent, gguf_file=embedded_gguf.name)


@pytest.fixture(scope="module")
def reference_model(embedded_gguf: Path, gguf_readers: dict[ReaderKey, Any]):
    from transformers import AutoModelForCausalLM

    with reading_each_gguf_once(gguf_readers):
        return AutoModelForCausalLM.from_pretrained(
            embedded_gguf.parent, gguf_file=embedded_gguf.name, dtype=torch.float32
        )


def test_module_does_not_import_torch() -> None:
    code = "import sys, vtllm.worker.loader.gguf_convert; assert 'torch' not in sys.modules"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_conversion_reports_progress_and_is_fast(
    conversion: tuple[Path, Path, list[str], float],
) -> None:
    cache_dir, model_dir, progress_lines, seconds = conversion
    assert model_dir.parent == cache_dir / "models"
    assert model_dir.name.startswith("SmolLM2-135M-Instruct.Q4_1-")
    counts = [line for line in progress_lines if line.endswith("/272 tensors")]
    assert 9 <= len(counts) <= 12, progress_lines
    assert counts[-1] == "converting SmolLM2-135M-Instruct.Q4_1.gguf: 272/272 tensors"
    assert progress_lines[-1].startswith("converted SmolLM2-135M-Instruct.Q4_1.gguf in ")
    assert seconds < 60
    # The staging directory was renamed away, nothing is left beside the result.
    assert [p.name for p in (cache_dir / "models").iterdir()] == [model_dir.name]


@pytest.mark.parametrize("text", TOKENIZER_SAMPLES)
def test_tokenizer_matches_transformers_gguf_tokenizer(
    model_dir: Path, reference_tokenizer, text: str
) -> None:
    ours = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids = ours.encode(text, add_special_tokens=True).ids
    assert ids == reference_tokenizer.encode(text, add_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=False) == text


def test_tokenizer_splits_digits_and_keeps_control_tokens_whole(model_dir: Path) -> None:
    ours = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    assert ours.encode("12345").tokens == ["1", "2", "3", "4", "5"]
    assert ours.encode(" 3.14").tokens == ["Ġ", "3", ".", "1", "4"]
    ids = ours.encode("<|im_start|>user\nHi<|im_end|>").ids
    assert ids[0] == 1 and ids[-1] == 2
    assert ours.decode(ids, skip_special_tokens=True) == "user\nHi"
    assert ours.get_vocab_size(with_added_tokens=True) == 49152


def test_weights_match_transformers_gguf_model(model_dir: Path, reference_model) -> None:
    ours = load_file(str(model_dir / "model.safetensors"))
    reference = reference_model.state_dict()
    # Tied embeddings: transformers exposes lm_head.weight, the file must not carry it.
    assert "lm_head.weight" not in ours
    assert set(ours) == set(reference) - {"lm_head.weight"}
    assert len(ours) == 272
    for name, tensor in ours.items():
        assert tensor.dtype == torch.bfloat16, name
        assert tensor.shape == reference[name].shape, name
        # Exact: both sides round the same float32 to nearest-even bf16.
        assert torch.equal(tensor, reference[name].to(torch.bfloat16)), name


def test_config_matches_transformers_gguf_config(model_dir: Path, reference_model) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    reference = reference_model.config
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["model_type"] == "llama"
    for field in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "vocab_size",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
    ):
        assert config[field] == getattr(reference, field), field
    assert config["rms_norm_eps"] == pytest.approx(reference.rms_norm_eps, rel=1e-6)
    assert config["rope_theta"] == reference.rope_parameters["rope_theta"] == 100000.0
    assert config["torch_dtype"] == "bfloat16"
    assert (config["hidden_size"], config["num_hidden_layers"]) == (576, 30)
    generation = json.loads((model_dir / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 1, "eos_token_id": 2}


def test_chat_template_renders_chatml(model_dir: Path) -> None:
    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert tokenizer_config["bos_token"] == "<|im_start|>"
    assert tokenizer_config["eos_token"] == "<|im_end|>"
    assert tokenizer_config["add_bos_token"] is False
    assert tokenizer_config["model_max_length"] == 8192
    template = jinja2.Environment().from_string(tokenizer_config["chat_template"])
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi there"},
    ]
    rendered = template.render(messages=messages, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_transformers_loads_the_converted_dir(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<|im_start|>", "<|im_end|>")
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert rendered.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_bfloat16_bits_match_torch_rounding() -> None:
    rng = np.random.default_rng(0)
    edge_values = np.array(
        [0.0, -0.0, 1.0, -2.5, np.inf, -np.inf, 3.4028235e38, 1e-40, 1.00390625, 1.01171875],
        dtype=np.float32,
    )
    values = np.concatenate([edge_values, rng.standard_normal(10_000).astype(np.float32) * 10])
    expected = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(float32_to_bfloat16_bits(values), expected)
    nan_bits = float32_to_bfloat16_bits(np.array([np.nan], dtype=np.float32))
    assert torch.isnan(torch.from_numpy(nan_bits.view(np.int16)).view(torch.bfloat16)).all()


def test_resolve_model_dir_reuses_cached_conversion(
    conversion: tuple[Path, Path, list[str], float],
) -> None:
    cache_dir, model_dir, _, _ = conversion
    weights_mtime = (model_dir / "model.safetensors").stat().st_mtime_ns
    progress_lines: list[str] = []
    assert resolve_model_dir(None, cache_dir, progress_lines.append) == model_dir
    assert (
        resolve_model_dir(str(find_embedded_gguf()), cache_dir, progress_lines.append) == model_dir
    )
    assert progress_lines == []
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == weights_mtime


def test_resolve_model_dir_accepts_and_checks_directories(model_dir: Path, tmp_path: Path) -> None:
    assert resolve_model_dir(str(model_dir), tmp_path) == model_dir
    incomplete = tmp_path / "incomplete"
    incomplete.mkdir()
    (incomplete / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="lacks tokenizer.json"):
        resolve_model_dir(str(incomplete), tmp_path)
    with pytest.raises(FileNotFoundError, match="neither a directory nor a .gguf"):
        resolve_model_dir(str(tmp_path / "nowhere"), tmp_path)


def test_losing_a_conversion_race_uses_the_winners_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gguf_path = tmp_path / "tiny.gguf"
    gguf_path.write_bytes(b"not really a gguf")
    cache_dir = tmp_path / "cache"
    digest = gguf_convert._sha256_of_file(gguf_path)
    winner_dir = cache_dir / "models" / gguf_convert.converted_dir_name("tiny", digest)

    def convert_while_another_process_wins(source: Path, out_dir: Path, progress=None) -> Path:
        # The other converter renames its complete directory into place first.
        winner_dir.mkdir(parents=True)
        for name in ("config.json", "tokenizer.json", "winner"):
            (winner_dir / name).write_text("{}")
        out_dir.mkdir(parents=True)
        for name in ("config.json", "tokenizer.json"):
            (out_dir / name).write_text("{}")
        return out_dir

    monkeypatch.setattr(gguf_convert, "convert_gguf_to_hf_dir", convert_while_another_process_wins)
    result = resolve_model_dir(str(gguf_path), cache_dir)
    assert result == winner_dir
    assert (result / "winner").exists()
    assert [p.name for p in (cache_dir / "models").iterdir()] == [result.name]


def test_unsupported_architecture_is_refused(tmp_path: Path) -> None:
    gguf_path = tmp_path / "other.gguf"
    writer = gguf.GGUFWriter(str(gguf_path), "falcon")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="architecture .falcon. is not supported yet"):
        gguf_convert.convert_gguf_to_hf_dir(gguf_path, tmp_path / "out")
    assert not (tmp_path / "out").exists()
