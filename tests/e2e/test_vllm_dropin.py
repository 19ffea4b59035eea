"""A vLLM user's first run: vLLM's quick-start command line (`vllm serve ORG/NAME --dtype
auto --api-key token-abc123`) plus common vLLM flags, run unchanged as `vtllm serve` on a
model named by its Hugging Face repo id, resolved offline from a pre-populated hub cache.
The SDK's models.retrieve, /ping, the access log without probes, --trust-remote-code
logged as unneeded."""

from __future__ import annotations

import re

import httpx
import openai
import pytest

from tests.e2e.server import ServerProcess
from tests.hf_cache import populate_hf_cache

REPO = "testorg/SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def dropin_server(tmp_path_factory, smollm2_dir, vt_cache_dir):
    hf_cache = tmp_path_factory.mktemp("hf-cache")
    populate_hf_cache(hf_cache, REPO, smollm2_dir)
    args = (
        f"{REPO} --dtype auto --api-key token-abc123 "  # vLLM's quick start
        "-tp 1 --trust-remote-code --disable-log-stats --max-model-len 1024 "
        "--gpu-memory-utilization 0.9 --max-num-seqs 8 --enable-prefix-caching "
        f"--download-dir {hf_cache} --kv-cache-memory 128MiB"
    ).split()
    server = ServerProcess(*args, env={"HF_HUB_OFFLINE": "1"}, cache_dir=vt_cache_dir)
    with server.serving() as srv:
        yield srv


def test_vllm_command_line_by_hub_name_offline(dropin_server):
    client = openai.OpenAI(base_url=f"{dropin_server.url}/v1", api_key="token-abc123", timeout=60)
    card = client.models.retrieve(REPO)  # GET /v1/models/testorg/SmolLM2-135M-Instruct
    assert card.id == REPO
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("testorg/other")
    out = client.completions.create(model=REPO, prompt="The capital of France is", max_tokens=4)
    assert out.usage.completion_tokens >= 1
    assert httpx.get(f"{dropin_server.url}/ping", timeout=5).status_code == 200
    for _ in range(3):
        httpx.get(f"{dropin_server.url}/metrics", timeout=5)
    log = dropin_server.log()
    assert "--trust-remote-code is not needed" in log
    # start-up progress: each slow phase announced, the loading with its duration
    assert "loading " in log and "allocating the KV cache (" in log
    assert re.search(r"loaded \S+ \(\S+\) in [0-9.]+s", log)
    assert '"POST /v1/completions HTTP/1.1" 200' in log  # the access log is on
    for probe in ("GET /health ", "GET /ping ", "GET /metrics "):
        assert probe not in log, probe  # probes never reach it
