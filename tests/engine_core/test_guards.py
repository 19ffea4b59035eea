"""The start-up KV guard ``check_kv_cache_fits``: pool size from the workers' bytes,
max_model_len fitted or refused with the numbers and the flag to change."""

from __future__ import annotations

import logging

import pytest

from vtllm.engine_core.guards import KVCacheTooSmallError, KVFit, check_kv_cache_fits

BLOCK = 16
PER_TOKEN = 46080  # SmolLM2-135M, fp32
PER_BLOCK = PER_TOKEN * BLOCK


def fit(num_bytes: int, model_max_len: int = 8192, pinned: int | None = None, **kw) -> KVFit:
    return check_kv_cache_fits(
        usable_kv_bytes=num_bytes,
        kv_bytes_per_token=PER_TOKEN,
        block_size=BLOCK,
        model_max_len=model_max_len,
        pinned_max_model_len=pinned,
        **kw,
    )


def test_model_limit_kept_when_it_fits(caplog):
    # 513 blocks: 512 usable = 8192 tokens, exactly the model's limit; bytes round down
    with caplog.at_level(logging.WARNING, logger="vtllm.engine_core.guards"):
        assert fit(513 * PER_BLOCK + PER_BLOCK - 1) == KVFit(max_model_len=8192, num_blocks=513)
    assert caplog.records == []


def test_pinned_length_that_fits_is_kept():
    assert fit(100 * PER_BLOCK, pinned=1000) == KVFit(max_model_len=1000, num_blocks=100)


def test_unpinned_length_auto_fitted_and_logged(caplog):
    with caplog.at_level(logging.WARNING, logger="vtllm.engine_core.guards"):
        result = fit(45 * PER_BLOCK)
    assert result == KVFit(max_model_len=44 * BLOCK, num_blocks=45)
    (record,) = caplog.records
    assert "auto-fitted from 8192 to 704" in record.message
    assert "513 blocks of 16 tokens, incl. 1 reserved" in record.message
    assert "raise --kv-cache-memory to keep 8192" in record.message


def test_pinned_length_too_large_refuses_with_numbers():
    with pytest.raises(KVCacheTooSmallError) as info:
        fit(45 * PER_BLOCK, pinned=8192, memory_flag="--gpu-memory-utilization")
    message = str(info.value)
    assert message.startswith("--max-model-len 8192 needs 0.352 GiB of KV cache (513 blocks")
    assert "only 0.031 GiB (45 blocks) is available" in message
    assert "Lower --max-model-len to 704 or less" in message
    assert "--gpu-memory-utilization" in message


@pytest.mark.parametrize("pinned", [None, 16])
@pytest.mark.parametrize("num_blocks", [0, 1])
def test_less_than_one_usable_block_refuses(num_blocks, pinned):
    with pytest.raises(KVCacheTooSmallError) as info:
        fit(num_blocks * PER_BLOCK + PER_BLOCK // 2, pinned=pinned)
    message = str(info.value)
    assert f"holds only {num_blocks} blocks" in message
    assert "a block of 16 tokens takes 0.703 MiB, and 1 block is reserved" in message
    assert "not one usable block; give it more memory (--kv-cache-memory)" in message


def test_two_blocks_hold_one_block_of_tokens():
    assert fit(2 * PER_BLOCK, model_max_len=BLOCK) == KVFit(max_model_len=BLOCK, num_blocks=2)
