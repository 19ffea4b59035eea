"""`vtllm serve --model gemma3-270m` end to end: the Gemma 3 270M GGUF assembled from its
four PyPI part packages, converted, served; a greedy completion equals transformers' greedy
continuation of the same GGUF (recorded in tests/worker/test_gemma3_gguf.py, which checks it
against transformers live), and chat is refused because the base model has no template."""

from __future__ import annotations

import httpx
import pytest

from tests.worker.test_gemma3_gguf import GREEDY_IDS, GREEDY_TEXT, PROMPT
from vtllm.worker.loader.gguf_packages import find_parted_gguf, part_paths

from .server import ServerProcess

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(vt_cache_dir):
    try:
        part_paths(find_parted_gguf("gemma3-270m"))
    except FileNotFoundError as e:
        pytest.skip(str(e))
    with ServerProcess(
        "--model", "gemma3-270m", "--kv-cache-memory", "128MiB", cache_dir=vt_cache_dir
    ).serving(timeout_s=300) as srv:  # includes assembling and converting on a cold cache
        yield srv


def test_greedy_completion_matches_transformers(server):
    reply = httpx.post(
        f"{server.url}/v1/completions",
        json={
            "model": "gemma3-270m",
            "prompt": PROMPT,
            "max_tokens": len(GREEDY_IDS),
            "temperature": 0,
        },
        timeout=120,
    )
    assert reply.status_code == 200, f"{reply.text}\n{server.log()}"
    body = reply.json()
    assert body["model"] == "gemma3-270m"
    assert body["choices"][0]["text"] == GREEDY_TEXT
    usage = body["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (6, len(GREEDY_IDS))  # <bos>+5


def test_chat_is_refused_without_a_template(server):
    reply = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"model": "gemma3-270m", "messages": [{"role": "user", "content": "Hi"}]},
        timeout=30,
    )
    assert reply.status_code == 400, reply.text
    assert "no chat template" in reply.json()["error"]["message"]
