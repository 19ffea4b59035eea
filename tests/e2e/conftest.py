"""One default `vtllm serve` (the embedded model, 512 MiB of KV) shared by the end-to-end
modules that need nothing special: a server start costs seconds on this CPU."""

from __future__ import annotations

import openai
import pytest

from tests.e2e.server import ServerProcess

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="session")
def server(smollm2_dir, vt_cache_dir):
    with ServerProcess("--kv-cache-memory", "512MiB", cache_dir=vt_cache_dir).serving() as srv:
        yield srv


def openai_client(server: ServerProcess) -> openai.OpenAI:
    """The `openai` SDK's client of a running server."""
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=120)


def served_model(client: openai.OpenAI) -> str:
    """The one model the server serves: the embedded SmolLM2."""
    served = [m.id for m in client.models.list().data]
    assert served == ["SmolLM2-135M-Instruct"]
    return served[0]


@pytest.fixture(scope="session")
def client(server):
    return openai_client(server)


@pytest.fixture(scope="session")
def model(client):
    return served_model(client)
