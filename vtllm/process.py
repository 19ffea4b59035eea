"""What every process vtllm spawns does first: name itself, die with its parent, log."""

from __future__ import annotations

import contextlib
import ctypes
import signal
import sys
from collections.abc import Callable, Iterator
from typing import Any

from vtllm.log import configure_logging

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Linux: deliver ``sig`` to this process when its parent exits (even by SIGKILL), so
    a crashed server never leaves orphan engine cores or workers holding a GPU."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)


class StopRequested(KeyboardInterrupt):
    """SIGTERM or SIGINT during start-up (``stop_signals_raise``). A KeyboardInterrupt, so
    that asyncio, threads and ``except Exception`` treat it as Ctrl-C is treated: it
    unwinds to the caller's cleanup and nothing swallows it."""


@contextlib.contextmanager
def stop_signals_handled(handler: Callable[[int, Any], None]) -> Iterator[None]:
    """Within: ``handler`` takes SIGINT and SIGTERM (main thread only: where Python runs
    signal handlers); the handlers in place before are restored on the way out."""
    sigs = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.signal(sig, handler) for sig in sigs}
    try:
        yield
    finally:
        for sig, before in previous.items():
            signal.signal(sig, before)


def stop_signals_raise() -> contextlib.AbstractContextManager[None]:
    """Within: SIGTERM and SIGINT raise ``StopRequested`` in the main thread. For start-up
    (loading weights, profiling, graph capture: minutes on a large model), where the
    default action would kill the process before it stopped its children (they would
    then outlive it, holding the GPU, until their own start-up ended) and a handler that
    only records the signal would make the stop wait for the whole start-up. Only the
    first signal raises: the cleanup it starts (stopping workers) must not be cut short
    by the next one (Ctrl-C's SIGINT to the group, then the parent's SIGTERM)."""

    def raise_stop(signum: int, frame: Any) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)  # until the block ends (then restored)
        raise StopRequested(signal.Signals(signum).name)

    return stop_signals_handled(raise_stop)


def set_process_title(title: str) -> None:
    """Visible in ``ps`` (cmdline and, truncated to 15 chars, comm)."""
    try:
        import setproctitle

        setproctitle.setproctitle(title)
        setproctitle.setthreadtitle(title[:15])
    except ImportError:
        pass


def become_child_process(title: str, controlled_by_parent: bool = False) -> None:
    """Name the process, tie its life to its parent's, set up logging.

    ``controlled_by_parent`` (workers): ignore SIGINT/SIGTERM — Ctrl-C and a
    control-group SIGTERM reach every process at once, and a worker must not die before
    its engine core has told it to stop — and die by SIGKILL with the parent instead.
    """
    if controlled_by_parent:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        die_with_parent(signal.SIGKILL)
    else:
        die_with_parent()
    set_process_title(title)
    configure_logging(title)


def stop_resource_tracker() -> None:
    """Stop multiprocessing's resource-tracker helper (started by spawning a child
    process) and reap it, so that this process exits after its last child, not before.
    Left alone it notices our exit a moment later, racing "exit after every child"."""
    import multiprocessing.resource_tracker as resource_tracker

    stop = getattr(getattr(resource_tracker, "_resource_tracker", None), "_stop", None)
    if stop is not None:  # CPython 3.8+; private, hence the guard
        with contextlib.suppress(Exception):
            stop()
