"""``tokenizer.json`` and ``tokenizer_config.json`` from a GGUF's ``tokenizer.ggml.*`` metadata.

Two tokenizer models are supported:

* ``gpt2``: byte-level BPE with the file's merges (SmolLM2, Llama 3, ...);
* ``llama``: sentencepiece BPE with byte fallback (Gemma). The file carries no merges, so
  they are rebuilt from the vocabulary the way transformers' GGUF loader does: every split
  of a token into two vocabulary pieces is a merge, ranked by the token's position in the
  file (Gemma's scores do not follow its merge order; the order of the tokens does).

No torch: the frontend runs this before any worker starts.
"""

from __future__ import annotations

from typing import Any

from tokenizers import (
    AddedToken,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

Metadata = dict[str, Any]

# llama.cpp's `tokenizer.ggml.token_type` values (llama_token_type).
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4
_SPIECE_SPACE = "\u2581"  # ▁, sentencepiece's spelling of a space


def build_tokenizer(metadata: Metadata) -> Tokenizer:
    """The ``tokenizers`` tokenizer the GGUF describes. Raises ValueError for other models."""
    model_type = metadata.get("tokenizer.ggml.model")
    if model_type == "gpt2":
        tokenizer = _byte_level_bpe(metadata)
    elif model_type == "llama":
        tokenizer = _sentencepiece_bpe(metadata)
    else:
        raise ValueError(
            f"GGUF tokenizer model {model_type!r} is not supported; "
            "only byte-level BPE ('gpt2') and sentencepiece BPE ('llama')"
        )
    tokens = _tokens(metadata)
    token_types = metadata.get("tokenizer.ggml.token_type") or []
    tokenizer.add_special_tokens(
        [
            AddedToken(tokens[i], special=True, normalized=False)
            for i, kind in enumerate(token_types)
            if kind == _TOKEN_TYPE_CONTROL
        ]
    )
    tokenizer.add_tokens(
        [
            AddedToken(tokens[i], special=False, normalized=False)
            for i, kind in enumerate(token_types)
            if kind == _TOKEN_TYPE_USER_DEFINED
        ]
    )
    return tokenizer


def _tokens(metadata: Metadata) -> list[str]:
    tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
    if metadata.get("tokenizer.ggml.model") == "llama":
        # Gemma files store a token of spaces only as real spaces, while the normalizer turns
        # every space into ▁ before the model looks anything up.
        tokens = [_SPIECE_SPACE * len(t) if t and not t.strip(" ") else t for t in tokens]
    return tokens


def _byte_level_bpe(metadata: Metadata) -> Tokenizer:
    """Byte-level BPE, pre-tokenized the way ``tokenizer.ggml.pre`` says."""
    tokens = _tokens(metadata)
    merges = [tuple(merge.split(" ", 1)) for merge in metadata["tokenizer.ggml.merges"]]
    vocab = {token: token_id for token_id, token in enumerate(tokens)}
    tokenizer = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False)
    )
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if pre == "smollm":
        # llama.cpp splits on \p{N} before the GPT-2 regex; SmolLM2's own tokenizer.json says the
        # same thing as Digits(individual_digits=True) followed by ByteLevel.
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    elif pre in ("default", "gpt2", "gpt-2"):
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported by this converter")
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return tokenizer


def _sentencepiece_bpe(metadata: Metadata) -> Tokenizer:
    """Sentencepiece BPE as Gemma's own ``tokenizer.json`` spells it: spaces become ▁, no
    prefix space, unknown bytes fall back to ``<0xNN>`` tokens, BOS added when the file
    says ``add_bos_token``."""
    if metadata.get("tokenizer.ggml.add_space_prefix", False):
        raise ValueError("sentencepiece GGUF tokenizers with add_space_prefix are not supported")
    tokens = _tokens(metadata)
    vocab = {token: token_id for token_id, token in enumerate(tokens)}
    unk_id = metadata.get("tokenizer.ggml.unknown_token_id")
    tokenizer = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=_merges_from_vocab(vocab),
            unk_token=None if unk_id is None else tokens[int(unk_id)],
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    tokenizer.normalizer = normalizers.Replace(" ", _SPIECE_SPACE)
    tokenizer.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace(_SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    bos_id = metadata.get("tokenizer.ggml.bos_token_id")
    if metadata.get("tokenizer.ggml.add_bos_token", False) and bos_id is not None:
        bos = tokens[int(bos_id)]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0",
            pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
            special_tokens=[(bos, int(bos_id))],
        )
    return tokenizer


def _merges_from_vocab(vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Every ``(left, right)`` split of a token whose halves are both tokens, ranked by the
    token's id, then longer left piece first (transformers' ``generate_merges`` order)."""
    ranked: list[tuple[int, str, str]] = []
    for token, token_id in vocab.items():
        for split in range(len(token) - 1, 0, -1):
            left, right = token[:split], token[split:]
            if left in vocab and right in vocab:
                ranked.append((token_id, left, right))
    ranked.sort(key=lambda merge: merge[0])  # stable: keeps the longer-left-first order
    return [(left, right) for _, left, right in ranked]


def tokenizer_config(metadata: Metadata, config: dict[str, Any]) -> dict[str, Any]:
    """``tokenizer_config.json``: special tokens, BOS/EOS flags, the chat template if any."""
    tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
    token_types = metadata.get("tokenizer.ggml.token_type") or []

    def token_or_none(key: str) -> str | None:
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        return None if token_id is None else tokens[int(token_id)]

    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token_or_none("bos_token_id"),
        "eos_token": token_or_none("eos_token_id"),
        "unk_token": token_or_none("unknown_token_id"),
        "pad_token": token_or_none("padding_token_id"),
        "additional_special_tokens": [
            tokens[i] for i, kind in enumerate(token_types) if kind == _TOKEN_TYPE_CONTROL
        ],
        "add_bos_token": bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
        "add_prefix_space": bool(metadata.get("tokenizer.ggml.add_space_prefix", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
        "chat_template": metadata.get("tokenizer.chat_template"),
    }
