"""One ``/metrics`` over several frontend processes (``--api-server-count N``).

Each frontend process keeps its own registry (``FrontendMetrics``) and serves its text
on a unix socket of its own in the server's private runtime directory. The process that
answers a scrape (whichever the kernel gave the connection) reads every peer's text and
merges it with its own::

    scrape ──▶ frontend k ──┬─ own registry ───────────────┐
                            ├─ peer 0 (unix socket) ─ text ─┼─▶ merge ─▶ one exposition
                            └─ peer N-1 ─────────── text ───┘

Merging, per series (same name and labels):

* series each frontend counts for its own requests (request counts, tokens, latency
  histograms) are summed over the processes;
* ``*_created`` timestamps take the earliest;
* engine-wide series (``FrontendMetrics.ENGINE_WIDE``: the engine's gauges and the
  counters folded from its ``SchedulerStats``, which every client receives alike) come
  from the answering process alone, or they would count N times.

A peer that does not answer within ``PEER_TIMEOUT_S`` (stopping, or gone) is left out
and the scrape still answers; the log says which.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

logger = logging.getLogger(__name__)

PEER_TIMEOUT_S = 2.0
_MAX_TEXT_BYTES = 64 * 1024**2


@dataclass(frozen=True)
class MetricsPeers:
    """Where this process serves its own metrics, and where its peers serve theirs."""

    own_path: str
    peer_paths: Sequence[str] = field(default_factory=tuple)


async def serve_own_metrics(registry: CollectorRegistry, path: str) -> asyncio.AbstractServer:
    """Answer every connection to ``path`` with this process's own exposition, then close."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            writer.write(generate_latest(registry))
            await writer.drain()
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    return await asyncio.start_unix_server(answer, path)


async def _read_peer(path: str) -> str | None:
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(path), PEER_TIMEOUT_S)
    except (OSError, TimeoutError) as e:
        logger.warning("metrics of the frontend process at %s left out: %s", path, e)
        return None
    try:
        data = await asyncio.wait_for(reader.read(_MAX_TEXT_BYTES), PEER_TIMEOUT_S)
        return data.decode()
    except (OSError, TimeoutError) as e:
        logger.warning("metrics of the frontend process at %s left out: %s", path, e)
        return None
    finally:
        writer.close()


def merge_expositions(own: str, peers: Iterable[str], engine_wide: frozenset[str]) -> bytes:
    """One exposition from this process's text and its peers' (rules in the module doc).
    ``engine_wide``: family names (as the text parser names them) taken from ``own``."""
    families: dict[str, Metric] = {}
    for family in text_string_to_metric_families(own):
        families[family.name] = family
    for text in peers:
        for family in text_string_to_metric_families(text):
            base = family.name.removesuffix("_created")
            mine = families.get(family.name)
            if base in engine_wide:
                continue
            if mine is None:
                families[family.name] = family
                continue
            take_min = family.name.endswith("_created")
            index = {
                (s.name, tuple(sorted(s.labels.items()))): i for i, s in enumerate(mine.samples)
            }
            for sample in family.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                i = index.get(key)
                if i is None:
                    index[key] = len(mine.samples)
                    mine.samples.append(sample)
                    continue
                ours = mine.samples[i]
                value = min(ours.value, sample.value) if take_min else ours.value + sample.value
                mine.samples[i] = ours._replace(value=value)

    class _Merged:
        def collect(self) -> Iterable[Metric]:
            return families.values()

    return generate_latest(_Merged())  # type: ignore[arg-type]


async def scrape_all(
    registry: CollectorRegistry, peers: MetricsPeers, engine_wide: frozenset[str]
) -> bytes:
    """This process's metrics merged with every peer's that answers."""
    own = generate_latest(registry).decode()
    texts = await asyncio.gather(*(_read_peer(path) for path in peers.peer_paths))
    return merge_expositions(own, [t for t in texts if t is not None], engine_wide)
