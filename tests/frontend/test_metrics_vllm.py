"""vLLM parity of the HTTP surface: every vLLM v1 metric series (names, types, buckets,
``model_name``) under ``--metrics-prefix``; ``/v1/models/{id}``, ``/ping``; the model's
generation_config.json sampling defaults (``--generation-config``); ``--max-logprobs``;
probes out of the access log; CORS; and the Grafana dashboard in deploy/ naming only
series the server exports."""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

import pytest

from tests.frontend.conftest import scrape
from vtllm.config import VtllmConfig
from vtllm.frontend.app import ProbeAccessFilter
from vtllm.frontend.metrics import token_buckets

ROOT = Path(__file__).resolve().parents[2]

# vLLM v1 (vllm/v1/metrics/loggers.py): name → (type, buckets or None)
_LAT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
        7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]  # fmt: skip
_ITL = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
        7.5, 10.0, 20.0, 40.0, 80.0]  # fmt: skip
_REQ = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
        120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]  # fmt: skip
_TOK = "1-2-5 up to max_model_len"  # token_buckets(max_model_len), as vLLM's
VLLM_SERIES = {
    "num_requests_running": ("gauge", None),
    "num_requests_waiting": ("gauge", None),
    "kv_cache_usage_perc": ("gauge", None),
    "gpu_cache_usage_perc": ("gauge", None),
    "prefix_cache_queries": ("counter", None),
    "prefix_cache_hits": ("counter", None),
    "gpu_prefix_cache_queries": ("counter", None),
    "gpu_prefix_cache_hits": ("counter", None),
    "num_preemptions": ("counter", None),
    "prompt_tokens": ("counter", None),
    "generation_tokens": ("counter", None),
    "request_success": ("counter", None),
    "request_prompt_tokens": ("histogram", _TOK),
    "request_generation_tokens": ("histogram", _TOK),
    "iteration_tokens_total": (
        "histogram",
        [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384],
    ),
    "request_max_num_generation_tokens": ("histogram", _TOK),
    "request_params_n": ("histogram", [1, 2, 5, 10, 20]),
    "request_params_max_tokens": ("histogram", _TOK),
    "time_to_first_token_seconds": ("histogram", _LAT),
    "time_per_output_token_seconds": ("histogram", _ITL),
    "inter_token_latency_seconds": ("histogram", _ITL),
    "time_per_prefill_token_request_seconds": (
        "histogram",
        [0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0],
    ),
    "e2e_request_latency_seconds": ("histogram", _REQ),
    "request_queue_time_seconds": ("histogram", _REQ),
    "request_inference_time_seconds": ("histogram", _REQ),
    "request_prefill_time_seconds": ("histogram", _REQ),
    "request_decode_time_seconds": ("histogram", _REQ),
    "cache_config_info": ("gauge", None),
}


def families(text: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    return {f.name: f for f in text_string_to_metric_families(text)}


@pytest.mark.parametrize("prefix", ["vtllm", "vllm"])
async def test_every_vllm_series_with_prefix(serve, prefix) -> None:
    config = VtllmConfig()
    config.frontend.metrics_prefix = prefix
    served = await serve(config=config)
    r = await served.http.post("/v1/completions", json={"prompt": "Hi", "n": 2, "max_tokens": 3})
    assert r.status_code == 200, r.text
    found = families((await served.http.get("/metrics")).text)
    other = "vllm" if prefix == "vtllm" else "vtllm"
    assert not [n for n in found if n.startswith(f"{other}:")]
    for name, (kind, buckets) in VLLM_SERIES.items():
        family = found.get(f"{prefix}:{name}")
        assert family is not None, f"{prefix}:{name} missing"
        assert family.type == kind, (name, family.type)
        for sample in family.samples:
            if name != "cache_config_info":
                assert sample.labels.get("model_name") == "fake-model", (name, sample)
        if buckets == _TOK:
            buckets = token_buckets(served.app.state.serving.max_model_len)
        if buckets is not None:
            les = sorted(
                float(s.labels["le"]) for s in family.samples if s.name.endswith("_bucket")
            )
            assert les == [float(b) for b in buckets] + [float("inf")], name
    samples = await scrape(served.http)
    model = ("model_name", "fake-model")
    assert samples[(f"{prefix}:request_params_n_sum", frozenset({model}))] == 2
    assert samples[(f"{prefix}:request_params_max_tokens_sum", frozenset({model}))] == 3
    assert samples[(f"{prefix}:request_inference_time_seconds_count", frozenset({model}))] == 2
    assert samples[(f"{prefix}:iteration_tokens_total_sum", frozenset({model}))] >= 6
    info = found[f"{prefix}:cache_config_info"].samples[0]
    assert info.value == 1 and info.labels["block_size"] == "16"


async def test_model_by_id_and_ping(serve) -> None:
    served = await serve()
    name = (await served.http.get("/v1/models")).json()["data"][0]["id"]
    card = await served.http.get(f"/v1/models/{name}")
    assert card.status_code == 200 and card.json()["id"] == name
    assert card.json()["object"] == "model"
    missing = await served.http.get("/v1/models/org/other-model")
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "model_not_found"
    assert (await served.http.get("/ping")).status_code == 200


async def test_generation_config_defaults(serve, model_dir, tmp_path) -> None:
    with_defaults = tmp_path / "model"
    shutil.copytree(model_dir, with_defaults)
    (with_defaults / "generation_config.json").write_text(
        json.dumps({"temperature": 0.25, "top_k": 7, "top_p": 0.5, "max_new_tokens": 2})
    )
    served = await serve(model_path=with_defaults)
    r = await served.http.post("/v1/completions", json={"prompt": "Hi", "top_p": 0.9})
    assert r.status_code == 200, r.text
    params = served.fake.added[-1].sampling_params
    assert (params.temperature, params.top_k, params.top_p) == (0.25, 7, 0.9)
    assert params.max_tokens == 2  # max_new_tokens: the default max_tokens
    r = await served.http.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "x"}], "temperature": 0.0},
    )
    assert r.status_code == 200, r.text
    assert served.fake.added[-1].sampling_params.temperature == 0.0  # the request's own

    config = VtllmConfig()
    config.model.generation_config = "vllm"  # ignore the model's defaults
    plain = await serve(model_path=with_defaults, config=config)
    await plain.http.post("/v1/completions", json={"prompt": "Hi"})
    params = plain.fake.added[-1].sampling_params
    assert (params.temperature, params.top_k) == (1.0, 0)


async def test_max_logprobs(serve) -> None:
    config = VtllmConfig()
    config.frontend.max_logprobs = 2
    served = await serve(config=config)
    r = await served.http.post("/v1/completions", json={"prompt": "Hi", "logprobs": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"
    r = await served.http.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 5},
    )
    assert r.status_code == 400 and "--max-logprobs" in r.json()["error"]["message"]
    r = await served.http.post("/v1/completions", json={"prompt": "Hi", "logprobs": 2})
    assert r.status_code == 200, r.text


async def test_cors_only_when_asked(serve) -> None:
    plain = await serve()
    r = await plain.http.get("/v1/models", headers={"Origin": "http://ui.example"})
    assert "access-control-allow-origin" not in r.headers
    config = VtllmConfig()
    config.frontend.allowed_origins = '["http://ui.example"]'
    cors = await serve(config=config)
    r = await cors.http.get("/v1/models", headers={"Origin": "http://ui.example"})
    assert r.headers["access-control-allow-origin"] == "http://ui.example"


def test_probe_paths_left_out_of_the_access_log() -> None:
    def record(path: str) -> logging.LogRecord:
        args = ("127.0.0.1:5", "GET", path, "1.1", 200)
        return logging.LogRecord("uvicorn.access", 20, "", 0, '%s - "%s %s HTTP/%s" %d', args, None)

    keep = ProbeAccessFilter().filter
    assert not keep(record("/health")) and not keep(record("/metrics"))
    assert not keep(record("/ping")) and not keep(record("/health?x=1"))
    assert keep(record("/v1/completions")) and keep(record("/healthz"))


def test_grafana_dashboard_queries_name_exported_series() -> None:
    """Every PromQL expression of the dashboard names only vllm:* series that exist
    (histograms as _bucket/_sum/_count, counters as _total)."""
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "vtllm-dashboard.json").read_text())
    exported = set()
    for name, (kind, _) in VLLM_SERIES.items():
        if kind == "histogram":
            exported |= {f"vllm:{name}_bucket", f"vllm:{name}_sum", f"vllm:{name}_count"}
        elif kind == "counter":
            exported.add(f"vllm:{name}_total")
        else:
            exported.add(f"vllm:{name}")
    exprs = []

    def walk(node) -> None:
        if isinstance(node, dict):
            for key in ("expr", "definition"):  # panel queries, template variables
                if isinstance(node.get(key), str):
                    exprs.append(node[key])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(dashboard)
    assert len(exprs) >= 8
    for expr in exprs:
        names = re.findall(r"vllm:[a-zA-Z0-9_]+", expr)
        assert names, expr
        assert set(names) <= exported, (expr, set(names) - exported)


async def test_response_role(serve) -> None:
    config = VtllmConfig()
    config.frontend.response_role = "narrator"
    served = await serve(config=config)
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    r = await served.http.post("/v1/chat/completions", json=body)
    assert r.json()["choices"][0]["message"]["role"] == "narrator"
    r = await served.http.post("/v1/chat/completions", json={**body, "stream": True})
    first = json.loads(r.text.split("data: ", 2)[1].split("\n", 1)[0])
    assert first["choices"][0]["delta"]["role"] == "narrator"
