"""transformers' own GGUF loader, the tests' independent reference, parsing each file once.

For one GGUF, transformers builds a ``gguf.GGUFReader`` for the config, another for the
weights and another for the tokenizer. Each parses every metadata field into numpy views: for
Gemma 3's 262,144-token vocabulary that is 1.5 million views, ~30 s of CPU a parse on the
2-core CI VM (a model load went from 58 to 29 s of CPU with one parse). Inside
``reading_each_gguf_once``, every ``GGUFReader(path, mode)`` is the first one built for that
path and mode. A reader is a read-only memory map plus parsed fields that transformers only
reads, so what it assembles is the same. Open the block around transformers' calls only: the
code under test (``gguf_convert``) must build its own readers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ReaderKey = tuple[Path, str]


@contextlib.contextmanager
def reading_each_gguf_once(readers: dict[ReaderKey, Any] | None = None) -> Iterator[None]:
    """Within the block, ``gguf.GGUFReader`` returns one reader per (resolved path, mode),
    kept in ``readers`` (pass the same dict to share them between blocks)."""
    import gguf

    build = gguf.GGUFReader
    readers = {} if readers is None else readers

    def reader(path, mode: str = "r") -> gguf.GGUFReader:
        key = (Path(path).resolve(), mode)
        if key not in readers:
            readers[key] = build(path, mode)
        return readers[key]

    # transformers imports GGUFReader from the gguf module inside its loader, at each call
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", reader)
        yield
