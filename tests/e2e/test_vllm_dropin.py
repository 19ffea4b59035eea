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


def test_embeddings(dropin_server):
    """/v1/embeddings on the served decoder (last-token pooling): batched, token-id and
    text inputs agree, vectors are unit length, base64 equals the floats, usage counts."""
    import base64
    import math
    import struct

    headers = {"Authorization": "Bearer token-abc123"}
    url = f"{dropin_server.url}/v1/embeddings"
    texts = ["The capital of France is Paris.", "Bonjour"]
    r = httpx.post(url, json={"model": REPO, "input": texts}, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    vectors = [d["embedding"] for d in body["data"]]
    assert [d["index"] for d in body["data"]] == [0, 1]
    assert len(vectors[0]) == 576  # SmolLM2-135M's hidden size
    for v in vectors:
        assert abs(math.sqrt(sum(x * x for x in v)) - 1.0) < 1e-4
    assert max(abs(a - b) for a, b in zip(*vectors, strict=True)) > 1e-3  # inputs differ

    ids = httpx.post(
        f"{dropin_server.url}/tokenize", json={"prompt": texts[0]}, headers=headers, timeout=10
    ).json()["tokens"]
    assert body["usage"]["prompt_tokens"] >= len(ids)
    r = httpx.post(
        url, json={"input": ids, "encoding_format": "base64"}, headers=headers, timeout=60
    )
    assert r.status_code == 200, r.text
    raw = base64.b64decode(r.json()["data"][0]["embedding"])
    alone = struct.unpack(f"<{len(raw) // 4}f", raw)
    assert r.json()["usage"] == {"prompt_tokens": len(ids), "total_tokens": len(ids)}
    assert max(abs(a - b) for a, b in zip(alone, vectors[0], strict=True)) < 1e-3

    client = openai.OpenAI(base_url=f"{dropin_server.url}/v1", api_key="token-abc123")
    sdk = client.embeddings.create(model=REPO, input=texts[1])  # the SDK asks for base64
    assert max(abs(a - b) for a, b in zip(sdk.data[0].embedding, vectors[1], strict=True)) < 1e-3
    bad = httpx.post(url, json={"input": [[1, "x"]]}, headers=headers, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "input"
