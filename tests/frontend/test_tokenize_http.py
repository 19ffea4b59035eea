"""``/tokenize`` and ``/detokenize`` with the real SmolLM2 tokenizer, checked against the
HF ``tokenizers`` library directly."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

SMOLLM2_VOCAB = 49152
CHATML_HI = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
)


async def _serve(serve, smollm2_dir: Path):
    return await serve(model_path=smollm2_dir, vocab_size=SMOLLM2_VOCAB, max_model_len=2048)


async def test_prompt_round_trip(serve, smollm2_dir: Path) -> None:
    served = await _serve(serve, smollm2_dir)
    reference = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    text = "Grüße! 你好世界 🙂 naïve café — done."
    r = await served.http.post("/tokenize", json={"prompt": text, "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    expected = reference.encode(text).ids
    assert body == {
        "tokens": expected,
        "count": len(expected),
        "max_model_len": 2048,
        "token_strs": [reference.id_to_token(i) for i in expected],
    }
    r = await served.http.post("/detokenize", json={"tokens": body["tokens"]})
    assert r.status_code == 200 and r.json() == {"prompt": text}


async def test_messages_tokenize_like_chat(serve, smollm2_dir: Path) -> None:
    served = await _serve(serve, smollm2_dir)
    reference = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    messages = [{"role": "user", "content": "Hi"}]
    r = await served.http.post("/tokenize", json={"messages": messages})
    assert r.status_code == 200, r.text
    tokens = r.json()["tokens"]
    assert tokens == reference.encode(CHATML_HI, add_special_tokens=False).ids
    assert r.json()["count"] == len(tokens) and "token_strs" not in r.json()
    # exactly the prompt a chat completion sends to the engine
    await served.http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
    assert served.fake.added[-1].prompt_token_ids == tokens
    r = await served.http.post("/detokenize", json={"tokens": tokens})
    assert r.json()["prompt"] == CHATML_HI


async def test_tokenize_errors(serve, smollm2_dir: Path) -> None:
    served = await _serve(serve, smollm2_dir)
    cases = [
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
        ("/tokenize", {"messages": []}, "messages"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/detokenize", {"tokens": [SMOLLM2_VOCAB]}, "tokens"),
        ("/detokenize", {"tokens": [-1]}, "tokens[0]"),
        ("/detokenize", {}, "tokens"),
    ]
    for path, body, param in cases:
        r = await served.http.post(path, json=body)
        assert r.status_code == 400, (path, body, r.text)
        assert r.json()["error"]["param"] == param, (body, r.json())
    r = await served.http.post("/tokenize", json={"prompt": "a", "model": "other"})
    assert r.status_code == 404
