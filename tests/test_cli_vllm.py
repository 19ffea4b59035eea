"""vLLM command lines on the vtllm parser: aliases, refusals with reasons, the closest
flag for a typo, HTTP-only flags refused by engine-core and bench, MODEL positional, and
the "coming from vLLM" table of docs/USAGE.md checked against the parser."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from vtllm.cli import _validated_config, build_parser, main
from vtllm.vllm_compat import UNSUPPORTED

ROOT = Path(__file__).resolve().parents[1]


def parse(cmdline: str):
    parser = build_parser()
    args = parser.parse_args(shlex.split(cmdline))
    return _validated_config(parser, args)


def refused(cmdline: str, capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        main(shlex.split(cmdline))
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    return err


# vLLM's own documentation: the OpenAI-compatible server quick start, and a command line
# with its common serving flags (every one of them taken by vtllm)
VLLM_DOCS_COMMAND = "serve Qwen/Qwen2.5-1.5B-Instruct --dtype auto --api-key token-abc123"
VLLM_COMMON = (
    "serve {model} --host 127.0.0.1 --port 8000 -tp 1 --dtype half --max-model-len 2048 "
    "--gpu-memory-utilization 0.85 --max-num-seqs 32 --max-num-batched-tokens 1024 "
    "--trust-remote-code --generation-config vllm --uvicorn-log-level warning "
    "--disable-log-requests --disable-log-stats --max-logprobs 5 "
    "--allowed-origins '[\"http://localhost:3000\"]' --root-path /llm --seed 1 "
    "--served-model-name mine --enable-prefix-caching --enforce-eager --revision main "
    "--download-dir /tmp/hf --tokenizer {model} --block-size 16"
)


def test_vllm_docs_command_parses():
    config = parse(VLLM_DOCS_COMMAND)
    assert config.model.model == "Qwen/Qwen2.5-1.5B-Instruct"
    assert config.frontend.api_key == "token-abc123"


def test_vllm_common_flags_map_to_vtllm_fields():
    config = parse(VLLM_COMMON.format(model="/models/x"))
    assert config.parallel.tensor_parallel_size == 1
    assert config.model.dtype == "float16"  # half
    assert config.model.trust_remote_code is True
    assert config.model.generation_config == "vllm"
    assert config.frontend.uvicorn_log_level == "warning"
    assert config.frontend.enable_log_requests is False
    assert config.frontend.disable_log_stats is True
    assert config.frontend.max_logprobs == 5
    assert config.frontend.root_path == "/llm"
    assert config.model.tokenizer == "/models/x"
    assert parse("serve --dtype float").model.dtype == "float32"
    assert parse("serve -tp 2").parallel.tensor_parallel_size == 2
    assert parse("serve --enable-log-requests").frontend.enable_log_requests is True


def test_model_positional_and_flag(capsys):
    assert parse("serve org/a").model.model == "org/a"
    assert parse("serve --model org/a").model.model == "org/a"
    assert parse("serve org/a --model org/a").model.model == "org/a"
    err = refused("serve org/a --model org/b", capsys)
    assert "differ" in err


@pytest.mark.parametrize(
    ("cmdline", "expected"),
    [
        ("serve --max-model-lenght 5", "did you mean --max-model-len?"),
        ("serve --tensor-paralel-size 2", "did you mean --tensor-parallel-size?"),
        ("serve --swap-space 4", "--swap-space is a vLLM flag vtllm does not support: preempted"),
        ("serve --dtype fp7", "invalid choice 'fp7'"),
        ("serve --max-logprobs 50", "--max-logprobs must be in 0..20"),
        ("serve --allowed-origins '*'", "--allowed-origins takes a JSON list"),
        ("serve --ssl-keyfile k.pem", "--ssl-keyfile and --ssl-certfile go together"),
        ("engine-core --port 9000", "--port is an HTTP flag"),
        ("engine-core --api-key k", "--api-key is an HTTP flag"),
        ("engine-core --disable-log-requests", "--disable-log-requests is an HTTP flag"),
        ("bench latency --host 0.0.0.0", "--host is an HTTP flag"),
        ("bench throughput --tokenizer t", "--tokenizer is an HTTP flag"),
    ],
)
def test_mistakes_are_one_line_exit_2(cmdline, expected, capsys):
    assert expected in refused(cmdline, capsys)


def test_engine_core_keeps_engine_flags():
    parser = build_parser()
    args = parser.parse_args(["engine-core", "org/m", "--default-max-tokens", "7", "-tp", "2"])
    config = _validated_config(parser, args)
    assert config.model.model == "org/m"
    assert config.frontend.default_max_tokens == 7
    assert config.parallel.tensor_parallel_size == 2


def _table(heading: str) -> list[list[str]]:
    """Rows of the first table under ``heading`` in docs/USAGE.md (cells stripped)."""
    text = (ROOT / "docs" / "USAGE.md").read_text()
    section = text.split(heading, 1)[1]
    rows = []
    for line in section.splitlines()[1:]:
        if line.startswith("#"):
            break
        if line.startswith("|") and not set(line) <= set("|- "):
            rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows[1:]  # less the header


def test_usage_vllm_flag_table_matches_parser(capsys):
    rows = _table("### Coming from vLLM: flags")
    assert len(rows) >= 30
    serve_flags = set()
    parser = build_parser()
    for action in parser._subparsers._group_actions[0].choices["serve"]._actions:
        serve_flags.update(action.option_strings)
    seen = set()
    for vllm_cell, status, vtllm_cell, _why in rows:
        vllm_flags = re.findall(r"`(-[-\w]+)", vllm_cell)
        assert vllm_flags, vllm_cell
        seen.update(vllm_flags)
        if status == "same":
            for flag in vllm_flags:
                assert flag in serve_flags, f"{flag} documented as same, not a serve flag"
        elif status == "renamed":
            targets = re.findall(r"`(-[-\w]+)", vtllm_cell)
            assert targets and all(t in serve_flags for t in targets), vtllm_cell
            for flag in vllm_flags:
                assert flag in serve_flags, f"{flag} (renamed) is not accepted as an alias"
        elif status == "not supported":
            for flag in vllm_flags:
                assert flag not in serve_flags, f"{flag} documented unsupported but accepted"
                assert flag in UNSUPPORTED, f"{flag}: the parser gives no reason"
                err = refused(f"serve {flag} 1", capsys)
                assert UNSUPPORTED[flag] in err
        else:
            raise AssertionError(f"status {status!r} is not same / renamed / not supported")
    assert set(UNSUPPORTED) <= seen, "every refused vLLM flag is in the table"


def test_bench_reports_decode_graphs_only_where_workers_capture_them():
    from vtllm.bench import decode_graphs_used
    from vtllm.worker.platform import detect_platform

    cpu = detect_platform(0)
    assert not cpu.supports_graphs  # this suite runs on CPU
    assert decode_graphs_used(False, cpu.supports_graphs, "auto") is False
    assert decode_graphs_used(False, True, "auto") is True
    assert decode_graphs_used(True, True, "triton") is False  # --enforce-eager
    assert decode_graphs_used(False, True, "torch") is False  # VT_ATTENTION_BACKEND=torch


def test_bench_throughput_splits_the_timed_steps_by_kind():
    from vtllm.bench import step_split
    from vtllm.engine_core.step_log import StepTimes

    before = StepTimes(decode_steps=10, decode_s=0.1, decode_tokens=40, prefill_steps=2,
                       prefill_s=0.05, prefill_tokens=900)  # fmt: skip
    after = StepTimes(decode_steps=110, decode_s=1.3, decode_tokens=25_640, prefill_steps=6,
                      prefill_s=0.45, prefill_tokens=8_900)  # fmt: skip
    split = step_split(before.totals(), after.totals())
    assert split == {
        "busy_s": 1.6,
        "decode_steps": 100,
        "decode_ms_per_step": 12.0,
        "decode_tokens_per_step": 256.0,
        "decode_share": 0.75,
        "prefill_steps": 4,
        "prefill_ms_per_step": 100.0,
        "prefill_tokens_per_step": 2000.0,
        "prefill_share": 0.25,
    }
    assert step_split({"steps_total": 1}, {"steps_total": 2}) is None  # an older engine


def test_every_serve_flag_is_in_usage():
    doc = (ROOT / "docs" / "USAGE.md").read_text()
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    flags = {
        o
        for action in serve._actions
        for o in action.option_strings
        if o not in ("-h", "--help") and not o.startswith("--no-")
    }
    undocumented = sorted(f for f in flags if not re.search(rf"`{re.escape(f)}[` ]", doc))
    assert not undocumented, undocumented


def test_async_scheduling_is_unset_unless_a_flag_says_on_or_off():
    """vLLM's ``--async-scheduling`` / ``--no-async-scheduling``; unset, the engine core
    turns it on over GPU workers (``config.async_scheduling_enabled``)."""
    assert parse("serve org/m").scheduler.async_scheduling is None
    assert parse("serve org/m --async-scheduling").scheduler.async_scheduling is True
    assert parse("serve org/m --no-async-scheduling").scheduler.async_scheduling is False
