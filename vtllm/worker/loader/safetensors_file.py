"""One ``*.safetensors`` file, memory-mapped, its tensors handed out as zero-copy views.

File layout (the safetensors format)::

    [u64 little-endian N][N bytes of JSON header][data ...............................]
                          {name: {dtype, shape, data_offsets: [begin, end]}, ...}
                                                 ^ offsets count from the data start

The file is mapped copy-on-write (``MAP_PRIVATE``): a view is a real CPU tensor whose pages
the kernel reads from the page cache only when touched, so a weight loader that copies one
rank's rows out of it (``narrow(0, ...)``) reads just those rows' pages, and writes (which no
loader should make) never reach the file. ``release(name)`` drops a tensor's pages from this
process's resident set once its loader is done (``MADV_DONTNEED``; a later read refaults them
from the file, so a view someone kept stays correct). Nothing is ever read into a Python
``bytes`` / ``bytearray`` copy, and no tensor is materialised before it is asked for.

Unlike ``safetensors.safe_open`` (which copies each tensor out of its own mapping, leaving the
mapping's pages resident until the file closes), the host cost here is one tensor's pages.
"""

from __future__ import annotations

import contextlib
import json
import mmap
from dataclasses import dataclass
from pathlib import Path

import torch

# safetensors dtype name → torch dtype (the FP8 and unsigned kinds where this torch has them)
_DTYPES: dict[str, torch.dtype] = {
    name: dtype
    for name, dtype in {
        "F64": torch.float64,
        "F32": torch.float32,
        "F16": torch.float16,
        "BF16": torch.bfloat16,
        "I64": torch.int64,
        "I32": torch.int32,
        "I16": torch.int16,
        "I8": torch.int8,
        "U8": torch.uint8,
        "BOOL": torch.bool,
        "F8_E4M3": getattr(torch, "float8_e4m3fn", None),
        "F8_E5M2": getattr(torch, "float8_e5m2", None),
        "F8_E8M0": getattr(torch, "float8_e8m0fnu", None),
        "U16": getattr(torch, "uint16", None),
        "U32": getattr(torch, "uint32", None),
        "U64": getattr(torch, "uint64", None),
    }.items()
    if dtype is not None
}
_MAX_HEADER_BYTES = 100 * 2**20  # the format's own cap
# the largest page-cache folio: a PMD (512 entries of 8 bytes per page: 2 MiB on 4 KiB pages)
_FOLIO_MARGIN = mmap.PAGESIZE * (mmap.PAGESIZE // 8)


class SafetensorsFormatError(ValueError):
    """The file is not a well-formed safetensors file (names the file and the defect)."""


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives in the file: absolute byte range, dtype, shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute file offset of the first byte
    end: int  # one past the last byte

    @property
    def num_bytes(self) -> int:
        return self.end - self.begin


class MappedSafetensors:
    """A mapped safetensors file; use as a context manager (``close`` unmaps)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            size = self.path.stat().st_size
            self.entries = _read_header(f, size, self.path)
            # a zero-length file cannot be mapped; one with only empty tensors needs no map
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size else None

    def __enter__(self) -> MappedSafetensors:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def names(self) -> list[str]:
        """Tensor names in file order (ascending offset: the disk is read front to back)."""
        return [e.name for e in sorted(self.entries.values(), key=lambda e: e.begin)]

    def tensor(self, name: str) -> torch.Tensor:
        """A zero-copy CPU view of ``name``; its pages load when first touched."""
        entry = self.entries[name]
        if entry.num_bytes == 0:
            return torch.empty(entry.shape, dtype=entry.dtype)
        raw = torch.frombuffer(
            self._map, dtype=torch.uint8, count=entry.num_bytes, offset=entry.begin
        )
        return raw.view(entry.dtype).view(entry.shape)

    def release(self, name: str) -> None:
        """Drop ``name``'s pages from this process's resident set, with ``_FOLIO_MARGIN``
        either side: a fault maps the whole page-cache folio it hits (large folios reach
        the PMD size) and its neighbours (fault-around), so touching one tensor also maps
        the edges of the tensors beside it. Tensors released in file order so leave
        nothing mapped behind them; a neighbour whose pages go early just refaults them."""
        entry = self.entries[name]
        if self._map is None or entry.num_bytes == 0 or not hasattr(mmap, "MADV_DONTNEED"):
            return
        start = max(0, entry.begin - _FOLIO_MARGIN)
        start -= start % mmap.PAGESIZE
        stop = min(len(self._map), entry.end + _FOLIO_MARGIN)
        self._map.madvise(mmap.MADV_DONTNEED, start, stop - start)

    def close(self) -> None:
        """Unmap. A view still alive somewhere keeps the mapping (the buffer is exported);
        it is then unmapped when the last view goes."""
        if self._map is None:
            return
        with contextlib.suppress(BufferError):  # a view is alive: unmapped when it goes
            self._map.close()
        self._map = None


def _read_header(f, file_size: int, path: Path) -> dict[str, TensorEntry]:
    prefix = f.read(8)
    if len(prefix) != 8:
        raise SafetensorsFormatError(f"{path}: shorter than the 8-byte header length")
    header_len = int.from_bytes(prefix, "little")
    if header_len > min(_MAX_HEADER_BYTES, file_size - 8):
        raise SafetensorsFormatError(f"{path}: header length {header_len} exceeds the file")
    try:
        header = json.loads(f.read(header_len))
    except ValueError as e:
        raise SafetensorsFormatError(f"{path}: header is not JSON ({e})") from e
    data_start = 8 + header_len
    entries: dict[str, TensorEntry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise SafetensorsFormatError(
                f"{path}: tensor {name} has dtype {info.get('dtype')!r}, which this torch "
                f"cannot hold (known: {', '.join(_DTYPES)})"
            )
        shape = tuple(int(d) for d in info["shape"])
        begin, end = (data_start + int(o) for o in info["data_offsets"])
        numel = 1
        for d in shape:
            numel *= d
        if end - begin != numel * dtype.itemsize or not data_start <= begin <= end <= file_size:
            raise SafetensorsFormatError(
                f"{path}: tensor {name} {info['dtype']}{list(shape)} has byte range "
                f"{info['data_offsets']}, which does not fit its shape or the file"
            )
        entries[name] = TensorEntry(name, dtype, shape, begin, end)
    return entries
