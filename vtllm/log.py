"""Logging set-up shared by every vtllm process: one line per event, no colours, the
process name in every line (journald reads it as is). ``--log-format json`` (or
``VT_LOG_FORMAT=json``) writes one JSON object per line for log shippers instead."""

from __future__ import annotations

import json
import logging
import sys
import time

from vtllm import envs

_FORMAT = "%(asctime)s %(levelname)s %(processName)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """``{"ts", "level", "process", "pid", "logger", "message"[, "exc"]}`` per line."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "process": record.processName,
            "pid": record.process,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def make_formatter() -> logging.Formatter:
    return JsonFormatter() if envs.VT_LOG_FORMAT == "json" else logging.Formatter(_FORMAT)


def configure_logging(process_name: str | None = None) -> None:
    if process_name:
        import multiprocessing

        multiprocessing.current_process().name = process_name
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(make_formatter())
    root.addHandler(handler)
    root.setLevel(envs.VT_LOG_LEVEL)
    # uvicorn's loggers carry handlers of their own: route them through ours.
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True


class ProgressLog:
    """A progress bar drawn as log lines (journald and pipes get whole lines, no ``\\r``):
    one line when each tenth of the work is done, and one at the end::

        capturing decode graphs [#####-----] 18/35 (batch 120) 1.2s
    """

    def __init__(self, logger: logging.Logger, label: str, total: int, width: int = 10) -> None:
        self.logger = logger
        self.label = label
        self.total = max(1, total)
        self.width = width
        self.done = 0
        self._last_tenth = -1
        self._started = time.monotonic()

    def advance(self, detail: str = "") -> None:
        self.done += 1
        tenth = self.done * 10 // self.total
        if tenth == self._last_tenth and self.done < self.total:
            return
        self._last_tenth = tenth
        filled = self.done * self.width // self.total
        bar = "#" * filled + "-" * (self.width - filled)
        suffix = f" ({detail})" if detail else ""
        elapsed = time.monotonic() - self._started
        self.logger.info(
            "%s [%s] %d/%d%s %.1fs", self.label, bar, self.done, self.total, suffix, elapsed
        )
