"""torch.save's file format for one tensor, written without torch: the older format's `payloads/<name>.pt`.

`export` copies payloads out of a native bundle as raw little-endian bytes, so it has no math to do
and should run where torch is not installed. This module writes what `torch.save(tensor)` writes for
a plain contiguous CPU tensor (the zip-based format torch has produced since 1.6), so that
`torch.load(..., weights_only=True)` reads it back, through the copying and the `mmap=True` paths:

    archive/data.pkl                 protocol-2 pickle:
                                     torch._utils._rebuild_tensor_v2(storage, 0, shape, stride, False, OrderedDict())
                                     with `storage` the persistent id ('storage', torch.<X>Storage, '0', 'cpu', numel)
    archive/.format_version          "1"
    archive/.storage_alignment       "64"
    archive/byteorder                "little"
    archive/data/0                   the tensor's bytes
    archive/version                  "3\\n"
    archive/.data/serialization_id   40 decimal digits derived from the content (as torch does), so a
                                     payload always encodes to the same bytes and the same SHA-256

The zip is uncompressed and every entry's data starts on a 64-byte boundary (torch memory-maps the
storage in place, and wide dtypes need aligned memory), padded with an extra field in the local
header. Every entry carries zip64 sizes and offsets, so a storage past 4 GiB needs no second layout.

The pickle is assembled from opcodes: pickling references to torch's globals with `pickle` itself
would need torch importable.
"""

from __future__ import annotations

import math
import pickle
import struct
import zlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

from trajectory_replay.bundle import codec
from trajectory_replay.errors import BundleError

if TYPE_CHECKING:
    import torch

Buffer = bytes | bytearray | memoryview

ARCHIVE = "archive"
"""The entries' folder; torch names it after the file when saving to a path and `archive` for a stream,
and its reader takes whatever the first entry uses."""
ALIGNMENT = 64

_STORAGE_CLASSES = {
    "torch.float64": "DoubleStorage",
    "torch.float32": "FloatStorage",
    "torch.float16": "HalfStorage",
    "torch.bfloat16": "BFloat16Storage",
    "torch.int64": "LongStorage",
    "torch.int32": "IntStorage",
    "torch.int16": "ShortStorage",
    "torch.int8": "CharStorage",
    "torch.uint8": "ByteStorage",
    "torch.bool": "BoolStorage",
}
"""Manifest dtype -> the typed-storage class torch names in the pickle (torch maps it back to the dtype)."""


class RawTensor(NamedTuple):
    """A tensor as bytes: `data` little-endian and row-major, `dtype` the manifest spelling, `shape` its size."""

    data: Buffer
    dtype: str
    shape: tuple[int, ...]


def raw_tensor(tensor: torch.Tensor) -> RawTensor:
    """The bytes, dtype and shape of a contiguous CPU copy of `tensor` (its storage may be larger: a view)."""
    import torch

    if tensor.layout != torch.strided:
        raise BundleError(f"a {tensor.layout} tensor cannot be written; only dense tensors")
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return RawTensor(flat.view(torch.uint8).numpy().tobytes(), str(tensor.dtype), tuple(tensor.shape))


def encode_pt(data: Buffer, dtype: str, shape: Sequence[int]) -> bytes:
    """The torch.save file of the tensor of `shape` and `dtype` (manifest spelling, `torch.float32`) whose
    little-endian row-major bytes are `data`; BundleError when the three do not describe one tensor."""
    name = codec.manifest_dtype(dtype)
    if name not in _STORAGE_CLASSES:  # the codec's list and this table are checked against each other in tests
        raise BundleError(f"unsupported dtype {dtype!r}")
    dims = tuple(shape)
    if any(type(d) is not int or d < 0 for d in dims):
        raise BundleError(f"shape {list(dims)} must list non-negative integers")
    size = codec.itemsize(name)
    count = math.prod(dims)
    if len(data) != count * size:
        raise BundleError(f"{len(data)} bytes do not hold shape {list(dims)} of {name} ({count * size} bytes)")
    pickled = _pickle(_STORAGE_CLASSES[name], count, dims)
    # from the content only: equal payloads must give byte-identical files (their SHA-256 is in the manifest)
    serial = f"{zlib.crc32(pickled):020d}{zlib.crc32(data):020d}"
    return _stored_zip(
        [
            ("data.pkl", pickled),
            (".format_version", b"1"),
            (".storage_alignment", str(ALIGNMENT).encode()),
            ("byteorder", b"little"),
            ("data/0", data),
            ("version", b"3\n"),
            (".data/serialization_id", serial.encode()),
        ]
    )


# ---- the pickle ---------------------------------------------------------------------------------


def _global(module: str, name: str) -> bytes:
    return pickle.GLOBAL + f"{module}\n{name}\n".encode()


def _text(value: str) -> bytes:
    raw = value.encode()
    return pickle.BINUNICODE + struct.pack("<I", len(raw)) + raw


def _int(value: int) -> bytes:
    # pickle picks the shortest opcode for a plain int (BININT1 .. LONG1) and memoizes none of them
    return pickle.dumps(value, protocol=2)[2:-1]


def _tuple(items: Sequence[bytes]) -> bytes:
    short = {0: pickle.EMPTY_TUPLE, 1: pickle.TUPLE1, 2: pickle.TUPLE2, 3: pickle.TUPLE3}.get(len(items))
    if short is not None:
        return b"".join(items) + short
    return pickle.MARK + b"".join(items) + pickle.TUPLE


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major strides as torch gives a contiguous tensor: a dimension of size 0 steps like one of size 1."""
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= max(d, 1)
    return tuple(reversed(strides))


def _pickle(storage_class: str, count: int, shape: tuple[int, ...]) -> bytes:
    storage = _tuple([_text("storage"), _global("torch", storage_class), _text("0"), _text("cpu"), _int(count)])
    args = _tuple(
        [
            storage + pickle.BINPERSID,
            _int(0),
            _tuple([_int(d) for d in shape]),
            _tuple([_int(s) for s in _contiguous_strides(shape)]),
            pickle.NEWFALSE,
            _global("collections", "OrderedDict") + pickle.EMPTY_TUPLE + pickle.REDUCE,
        ]
    )
    return (
        pickle.PROTO + bytes([2]) + _global("torch._utils", "_rebuild_tensor_v2") + args + pickle.REDUCE + pickle.STOP
    )


# ---- the zip ------------------------------------------------------------------------------------

_ZIP64_VERSION = 45
_DOS_DATE = (1 << 5) | 1  # 1980-01-01: the earliest date a zip can state
_UNSET32 = 0xFFFFFFFF
_PAD_FIELD = b"FB"  # an extra field no reader interprets; torch pads with the same id


def _stored_zip(entries: list[tuple[str, Buffer]]) -> bytes:
    """An uncompressed zip of `entries` under ARCHIVE/, each entry's data aligned to ALIGNMENT."""
    parts: list[Buffer] = []
    central: list[bytes] = []
    offset = 0
    for entry, data in entries:
        name = f"{ARCHIVE}/{entry}".encode()
        crc = zlib.crc32(data)
        zip64 = struct.pack("<HHQQ", 1, 16, len(data), len(data))
        unpadded = offset + 30 + len(name) + len(zip64) + 4
        pad = _PAD_FIELD + struct.pack("<H", -unpadded % ALIGNMENT) + b"Z" * (-unpadded % ALIGNMENT)
        extra = zip64 + pad
        local = struct.pack(
            "<IHHHHHIIIHH",
            0x04034B50,
            _ZIP64_VERSION,
            0,
            0,
            0,
            _DOS_DATE,
            crc,
            _UNSET32,
            _UNSET32,
            len(name),
            len(extra),
        )
        parts += [local, name, extra, data]
        central_extra = struct.pack("<HHQQQ", 1, 24, len(data), len(data), offset)
        central.append(
            struct.pack(
                "<IHHHHHHIIIHHHHHII",
                0x02014B50,
                _ZIP64_VERSION,
                _ZIP64_VERSION,
                0,
                0,
                0,
                _DOS_DATE,
                crc,
                _UNSET32,
                _UNSET32,
                len(name),
                len(central_extra),
                0,
                0,
                0,
                0,
                _UNSET32,
            )
            + name
            + central_extra
        )
        offset += len(local) + len(name) + len(extra) + len(data)
    directory = b"".join(central)
    count, end64 = len(entries), offset + len(directory)
    tail = (
        struct.pack(
            "<IQHHIIQQQQ", 0x06064B50, 44, _ZIP64_VERSION, _ZIP64_VERSION, 0, 0, count, count, len(directory), offset
        )
        + struct.pack("<IIQI", 0x07064B50, 0, end64, 1)
        + struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, count, count, len(directory), min(offset, _UNSET32), 0)
    )
    return b"".join([*parts, directory, tail])


__all__ = ["ALIGNMENT", "ARCHIVE", "RawTensor", "encode_pt", "raw_tensor"]
