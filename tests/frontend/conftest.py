"""Fixtures: a small real byte-level BPE tokenizer in a HF-style model dir, and a
frontend served by uvicorn in the test's event loop against ``FakeEngine``."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tests.frontend.fake_engine import FakeEngine
from vtllm.config import VtllmConfig
from vtllm.frontend.app import build_app, uvicorn_config
from vtllm.protocol.async_client import EngineClient

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

_CORPUS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "A small language model answers questions about the world.",
    "The end of the story is near; stop here and say hello again.",
    "system user assistant: you are a helpful assistant.",
] * 20


def write_model_dir(path: Path, chat_template: str | None = CHATML_TEMPLATE) -> Path:
    """A HF-style dir with a trained byte-level BPE tokenizer (ASCII merges only, so
    emoji and CJK split into several byte tokens)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS, trainer)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path / "tokenizer.json"))
    config: dict[str, Any] = {
        "bos_token": None,
        "eos_token": {"content": "<|im_end|>", "special": True},
        "add_bos_token": False,
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}))
    return path


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path):
    from vtllm.frontend.tokenizer import ModelTokenizer

    return ModelTokenizer.from_dir(model_dir)


async def wait_until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Poll ``predicate`` until true; fail the test after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s}s")
        await asyncio.sleep(0.02)


@dataclass
class Served:
    fake: FakeEngine
    engine: EngineClient
    base_url: str
    http: httpx.AsyncClient
    dead_reasons: list[str]
    app: Any = None


def _free_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


@pytest.fixture
async def serve(
    tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Callable[..., Any]]:
    """Factory: ``await serve(text=..., config=..., model_path=...)`` starts a FakeEngine
    that streams the tokens of ``text``, connects an EngineClient and serves the app."""
    monkeypatch.setenv("VT_HEARTBEAT_INTERVAL_S", "0.1")
    monkeypatch.setenv("VT_HEARTBEAT_TIMEOUT_S", "3")
    cleanups: list[Callable[[], Any]] = []

    async def start(
        text: str = "Hello world! The end.",
        config: VtllmConfig | None = None,
        model_path: Path | None = None,
        **fake_kwargs: Any,
    ) -> Served:
        from vtllm.frontend.tokenizer import ModelTokenizer

        path = model_path or model_dir
        token_ids = ModelTokenizer.from_dir(path).encode(text, add_special_tokens=False)
        fake = FakeEngine(f"ipc://{tmp_path}/engine-{len(cleanups)}.sock", token_ids, **fake_kwargs)
        fake.start()
        cleanups.append(fake.stop)
        dead_reasons: list[str] = []
        engine = EngineClient()
        await engine.connect(fake.address, "test", on_dead=dead_reasons.append, timeout_s=5)
        config = config or VtllmConfig()
        app = build_app(config, str(path), engine)
        sock = _free_socket()
        # the production settings (read deadlines, header bound), on this test's socket
        server = uvicorn.Server(uvicorn_config(app, config, log_level="warning", lifespan="off"))
        task = asyncio.create_task(server.serve(sockets=[sock]))
        await wait_until(lambda: server.started or task.done())
        port = sock.getsockname()[1]
        http = httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10)

        async def stop() -> None:
            await http.aclose()
            server.should_exit = True
            await asyncio.wait_for(task, 10)
            await engine.close()

        cleanups.append(stop)
        return Served(fake, engine, f"http://127.0.0.1:{port}", http, dead_reasons, app)

    yield start
    for cleanup in reversed(cleanups):
        result = cleanup()
        if asyncio.iscoroutine(result):
            await result


def parse_sse(body: str) -> list[str]:
    """The ``data:`` payloads of an SSE body, in order (comments excluded)."""
    events = [e for e in body.split("\n\n") if e]
    return [e[len("data: ") :] for e in events if e.startswith("data: ")]


async def scrape(http: httpx.AsyncClient) -> dict[tuple[str, frozenset], float]:
    """``/metrics`` as {(sample name, frozenset of label items): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    r = await http.get("/metrics")
    assert r.status_code == 200, r.text
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(r.text)
        for sample in family.samples
    }
