"""The pure pieces behind the HTTP bounds: JSON depth without recursion, the UTF-8 check,
clipping, and the bounded unknown-field log."""

from __future__ import annotations

import json
import logging
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vtllm.frontend.body_guard import check_body, json_nesting_over
from vtllm.frontend.openai_types import OpenAIError, clip
from vtllm.frontend.unknown_fields import UnknownFieldLog


def _reference_depth(value) -> int:
    if isinstance(value, list):
        return 1 + max(map(_reference_depth, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(_reference_depth, value.values()), default=0)
    return 0


json_values = st.recursive(
    st.none() | st.integers() | st.text(alphabet='[]{}"\\ab\n\u00e9'),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.text(alphabet='[]{}"\\k', max_size=3), inner, max_size=3)
    ),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(json_values, st.integers(0, 5))
def test_depth_agrees_with_a_recursive_reference(value, max_depth: int) -> None:
    body = json.dumps(value, ensure_ascii=False).encode()
    expected = _reference_depth(value)
    over = json_nesting_over(body, max_depth)
    if expected <= max_depth:
        assert over is None
    else:
        assert over is not None and max_depth < over <= expected


def test_deep_and_huge_bodies_are_cheap() -> None:
    deep = b'{"a": ' + b"[" * (15 << 20) + b"]" * (15 << 20) + b"}"  # 30 MiB, 15M deep
    started = time.perf_counter()
    assert json_nesting_over(deep, 64) > 64  # found in the first chunk: the scan stops
    assert time.perf_counter() - started < 0.5
    flat = b"[" + b"[1]," * 8_000_000 + b"[1]]"  # 32 MiB of shallow brackets: a full scan
    assert json_nesting_over(flat, 64) is None
    # a long chain split across chunks is followed across them
    chain = b"[" * 600_000 + b'"]]"' + b"]" * 600_000
    assert json_nesting_over(chain, 599_999) == 600_000
    assert json_nesting_over(chain, 600_000) is None
    assert time.perf_counter() - started < 3.0


def test_check_body_refuses_with_the_numbers() -> None:
    check_body(b'{"a": ' + b"[" * 63 + b"]" * 63 + b"}", max_depth=64)
    with pytest.raises(OpenAIError) as e:
        check_body(b'{"a": ' + b"[" * 64 + b"]" * 64 + b"}", max_depth=64)
    assert e.value.status_code == 400 and e.value.code == "json_too_deep"
    assert "deeper than 64 levels (65 seen)" in e.value.message
    with pytest.raises(OpenAIError) as e:
        check_body(b'{"k\xff": 1}', max_depth=64)
    assert e.value.status_code == 400 and "byte 3 of 9" in e.value.message


def test_clip() -> None:
    assert clip("short") == "short"
    clipped = clip("x" * 1000, 10)
    assert clipped == "xxxxxxxxxx... (1000 characters)"


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "vtllm.frontend.unknown_fields"]


def test_unknown_field_log_is_bounded_and_rate_limited(caplog) -> None:
    caplog.set_level(logging.WARNING, logger="vtllm.frontend.unknown_fields")
    clock = FakeClock()
    log = UnknownFieldLog(remember=50, max_lines=2, interval_s=10, max_names=3, clock=clock)
    log.report("Req", ["a", "b"])
    log.report("Req", ["a", "b"])  # already reported: no line
    assert _lines(caplog) == ["Req: ignoring unknown fields 'a', 'b'"]
    for i in range(10_000):  # distinct names: memory stays at `remember`
        log.report("Req", [f"name{i}-" + "z" * 500])
    assert len(log) == 50
    lines = _lines(caplog)
    assert len(lines) == 2 and len(lines[1]) < 200, lines  # rate-limited, names clipped
    clock.now = 10.0  # a new interval: one line, saying what was held back
    log.report("Req", ["c", "d", "e", "f"])
    assert _lines(caplog)[-1] == (
        "Req: ignoring unknown fields 'c', 'd', 'e' and 1 more "
        "(9999 such warnings held back by the rate limit)"
    )
