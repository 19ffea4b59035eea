"""Logging set-up shared by every vtllm process: one line per event, no colours unless a
TTY, the process name in every line (journald and log shippers read it as is)."""

from __future__ import annotations

import logging
import sys

from vtllm import envs

_FORMAT = "%(asctime)s %(levelname)s %(processName)s %(name)s: %(message)s"


def configure_logging(process_name: str | None = None) -> None:
    if process_name:
        import multiprocessing

        multiprocessing.current_process().name = process_name
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(_FORMAT))
    root.addHandler(handler)
    root.setLevel(envs.VT_LOG_LEVEL)
