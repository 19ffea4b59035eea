"""Qwen3-MoE and Mixtral through the model runner against transformers 5.24, plus the
router rules against transformers' own router modules.

Tolerance as for the dense families (``test_llama_vs_transformers.py``): fp32, full-vocab
logprobs within atol 1e-4 and identical greedy tokens, over a two-request prefill and 16
decode steps and a chunked prefill mixed with decode.
"""

from __future__ import annotations

import pytest

from .test_llama_vs_transformers import _prefill_then_decode
from .tiny_models import make_hf_model


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_prefill_whole_then_decode_two_requests(kind, tmp_path):
    _prefill_then_decode(tmp_path, make_hf_model(kind, tmp_path))
