"""The real tokenizer of the embedded SmolLM2 model (converted once per session)."""

from __future__ import annotations

from pathlib import Path

from vtllm.frontend.detokenizer import IncrementalDetokenizer, OutputText
from vtllm.frontend.tokenizer import ModelTokenizer


def test_smollm2_chatml_and_eos(smollm2_dir: Path) -> None:
    tok = ModelTokenizer.from_dir(smollm2_dir)
    text = tok.render_chat([{"role": "user", "content": "Hi"}])
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.tokenizer.token_to_id("<|im_end|>") in tok.eos_token_ids
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[0] == tok.tokenizer.token_to_id("<|im_start|>")


def test_smollm2_incremental_detokenization(smollm2_dir: Path) -> None:
    tok = ModelTokenizer.from_dir(smollm2_dir)
    text = "Grüße! 你好世界 🙂🎉 naïve café — done."
    ids = tok.encode(text, add_special_tokens=False)
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # some characters span tokens
    detok = IncrementalDetokenizer(tok.decode, tok.encode("Say:", add_special_tokens=False))
    deltas = [detok.push([i]) for i in ids]
    assert "".join(deltas) == text and not any("\ufffd" in d for d in deltas)
    out = OutputText(tok.decode, [], ["世界 🙂"])
    assert "".join(out.push([i]) for i in ids) == "Grüße! 你好"
