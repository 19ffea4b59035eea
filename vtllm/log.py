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
