"""msgpack encoding of protocol messages. No pickle, ever.

A decoder per direction: each accepts only the message kinds that may arrive on its side,
so a peer that sends anything else gets ``ProtocolError`` (the caller logs and drops it).
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import msgspec

from vtllm.protocol import messages as m

T = TypeVar("T")

# Frames larger than this are refused before decoding (a garbage or hostile peer).
MAX_FRAME_BYTES = 256 * 1024 * 1024


class ProtocolError(ValueError):
    """A frame that is not a valid message for this channel."""


_encoder = msgspec.msgpack.Encoder()


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


def encode_value(value: Any) -> bytes:
    """Encode a plain value (utility call args and results)."""
    return _encoder.encode(value)


def decode_value(raw: msgspec.Raw | bytes, type_: type[T] = Any) -> T:  # type: ignore[assignment]
    return msgspec.msgpack.decode(raw, type=type_)


class Decoder(Generic[T]):
    def __init__(self, union: Any) -> None:
        self._decoder = msgspec.msgpack.Decoder(union)

    def decode(self, frame: bytes | memoryview) -> T:
        if len(frame) > MAX_FRAME_BYTES:
            raise ProtocolError(f"frame of {len(frame)} bytes exceeds {MAX_FRAME_BYTES}")
        try:
            return self._decoder.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise ProtocolError(str(e)) from None


def client_to_engine_decoder() -> Decoder[m.ClientToEngine]:
    return Decoder(m.ClientToEngine)


def engine_to_client_decoder() -> Decoder[m.EngineToClient]:
    return Decoder(m.EngineToClient)


def worker_to_engine_decoder() -> Decoder[m.WorkerToEngine]:
    return Decoder(m.WorkerToEngine)


def engine_to_worker_decoder() -> Decoder[m.EngineToWorker]:
    return Decoder(m.EngineToWorker)
