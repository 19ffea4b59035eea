"""Embeddings on the worker: a pooling request's LAST / MEAN pooled final hidden state
equals transformers' last-layer hidden states (after the final norm) of the prompt, also
when the prompt is prefilled in chunks, and alongside an ordinary request."""

from __future__ import annotations

import pytest
import torch

from vtllm.protocol.messages import PoolingType, SamplingParams
from vtllm.worker.model_runner import ModelRunner

from .tiny_models import EngineSim, make_hf_model

PROMPT = [5, 17, 99, 3, 250, 41, 7, 64, 11, 300, 8]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-pool")
    hf = make_hf_model("qwen3", path)
    with torch.no_grad():
        states = hf(torch.tensor([PROMPT]), output_hidden_states=True).hidden_states[-1][0]
    return path, states  # [len(PROMPT), hidden], after the final norm


def _sim(path) -> EngineSim:
    runner = ModelRunner.from_model_dir(path, torch.device("cpu"), torch.float32, seed=0)
    runner.init_kv_cache(num_blocks=32, block_size=4)
    return EngineSim(runner.execute, num_blocks=32, block_size=4)


@pytest.mark.parametrize("chunks", [[len(PROMPT)], [4, 4, 3]])
def test_pooled_states_match_transformers(tiny, chunks):
    path, reference = tiny
    sim = _sim(path)
    for kind in (PoolingType.LAST, PoolingType.MEAN):
        sim.add(f"pool-{kind.name}", PROMPT, SamplingParams(max_tokens=1, pooling=kind))
    sim.add("gen", PROMPT[:5], SamplingParams(max_tokens=4))
    embeddings = {}
    for i, num in enumerate(chunks):
        schedule = {"pool-LAST": num, "pool-MEAN": num}
        if i == 0:
            schedule["gen"] = 5
        out = sim.step(schedule)
        embeddings.update(out.embeddings)
        if i < len(chunks) - 1:
            assert not out.embeddings  # nothing before the prompt completes
    assert set(embeddings) == {"pool-LAST", "pool-MEAN"}  # never for "gen"
    last = torch.tensor(embeddings["pool-LAST"])
    mean = torch.tensor(embeddings["pool-MEAN"])
    torch.testing.assert_close(last, reference[-1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(mean, reference.mean(dim=0), rtol=1e-4, atol=1e-4)


def test_qwen3_embedding_shaped_checkpoint(tmp_path):
    """A Qwen3-Embedding-shaped checkpoint (Qwen3Model weights without the "model." prefix,
    tied embeddings, config.json saying Qwen3ForCausalLM) loads, and last-token pooling
    equals transformers' last_hidden_state."""
    import json

    import transformers

    from .tiny_models import hf_config

    torch.manual_seed(0)
    bare = transformers.AutoModel.from_config(hf_config("qwen3"), dtype=torch.float32).eval()
    bare.save_pretrained(tmp_path, safe_serialization=True)
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["Qwen3ForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with torch.no_grad():
        reference = bare(torch.tensor([PROMPT])).last_hidden_state[0]  # [len, hidden]
    sim = _sim(tmp_path)
    sim.add("e", PROMPT, SamplingParams(max_tokens=1, pooling=PoolingType.LAST))
    out = sim.step({"e": len(PROMPT)})
    torch.testing.assert_close(
        torch.tensor(out.embeddings["e"]), reference[-1], rtol=1e-4, atol=1e-4
    )
