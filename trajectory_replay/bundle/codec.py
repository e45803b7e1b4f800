"""The tensor codec: one tensor per safetensors blob, under the name `data`. No pickle anywhere.

Headers are parsed and checked (size bound, one tensor, known dtype, offsets that exactly
cover the data, shape consistent with the byte count) before a byte of tensor data is
allocated or trusted. Row reads use the header to turn sample token offsets into byte
ranges of the blob.

Headers are parsed without torch (inspect and validate run where torch is not installed); torch is
imported only by the functions that build or return tensors.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

from trajectory_replay.bundle.documents import MAX_JSON_DEPTH, nesting_exceeds
from trajectory_replay.errors import BundleError
from trajectory_replay.outcome import QUOTE_LIMIT, one_line

if TYPE_CHECKING:
    import numpy
    import torch

TENSOR_NAME = "data"
MAX_HEADER_BYTES = 1 << 20
"""A header is one small JSON object; anything larger is refused before it is read."""
MAX_DIMS = 64
"""Most dimensions a stored tensor may have (the payloads here have one or two)."""
MAX_HEADER_INT = (1 << 63) - 1
"""Dimensions and offsets are int64 values in safetensors."""
MAX_TENSOR_BYTES = 1 << 62
"""Bound on a shape's byte size with zeros counted as ones: past it numpy and torch cannot describe the tensor
even when it is empty (a zero dimension would otherwise let the others be anything)."""

_DTYPES: dict[str, tuple[str, int]] = {
    "F64": ("torch.float64", 8),
    "F32": ("torch.float32", 4),
    "F16": ("torch.float16", 2),
    "BF16": ("torch.bfloat16", 2),
    "I64": ("torch.int64", 8),
    "I32": ("torch.int32", 4),
    "I16": ("torch.int16", 2),
    "I8": ("torch.int8", 1),
    "U8": ("torch.uint8", 1),
    "BOOL": ("torch.bool", 1),
}
"""safetensors dtype code -> (the manifest's spelling of the dtype, bytes per element)."""
_MANIFEST_NAMES = {name: code for code, (name, _) in _DTYPES.items()}


def dtype_name(dtype: torch.dtype | str) -> str:
    """The manifest spelling of a dtype (`torch.float32`; a `RawTensor`'s dtype is spelled so already), shared with
    the older format."""
    return str(dtype)


def manifest_dtype(name: str) -> str:
    """The canonical manifest spelling of a dtype string (`float32` or `torch.float32`); BundleError
    for one that cannot be stored."""
    canonical = name if name.startswith("torch.") else f"torch.{name}"
    if canonical not in _MANIFEST_NAMES:
        raise BundleError(f"unsupported dtype {name!r}")
    return canonical


def itemsize(name: str) -> int:
    """Bytes per element of a manifest dtype; BundleError for one that cannot be stored."""
    return _DTYPES[_MANIFEST_NAMES[manifest_dtype(name)]][1]


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a manifest dtype string; BundleError for an unknown one."""
    import torch

    return getattr(torch, manifest_dtype(name).removeprefix("torch."))


def check_storable(name: str, tensor: object) -> torch.Tensor | RawTensor:
    """The tensor, contiguous on the CPU, if it can be stored; BundleError naming the payload otherwise. A
    `RawTensor` is stored as it is (checked when it was made)."""
    if isinstance(tensor, RawTensor):
        if tensor.dtype not in _MANIFEST_NAMES:
            raise BundleError(f"payload {name!r}: dtype {tensor.dtype} cannot be stored")
        return tensor
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise BundleError(f"payload {name!r}: expected a torch.Tensor, got {type(tensor).__name__}")
    if str(tensor.dtype) not in _MANIFEST_NAMES:
        raise BundleError(f"payload {name!r}: dtype {tensor.dtype} cannot be stored")
    if tensor.is_sparse or tensor.layout != torch.strided:
        raise BundleError(f"payload {name!r}: only dense tensors can be stored")
    return tensor.detach().to("cpu").contiguous()


def encode(tensor: torch.Tensor | RawTensor) -> tuple[bytes, int]:
    """(safetensors bytes, offset where the tensor data starts). A `RawTensor` is laid out without torch, byte for
    byte as safetensors lays out the same torch tensor: the header's compact JSON padded with spaces to a multiple
    of 8 bytes, then the data."""
    if isinstance(tensor, RawTensor):
        code = _MANIFEST_NAMES[tensor.dtype]
        header = json.dumps(
            {TENSOR_NAME: {"dtype": code, "shape": list(tensor.shape), "data_offsets": [0, len(tensor.data)]}},
            separators=(",", ":"),
        ).encode()
        header += b" " * (-len(header) % 8)
        return struct.pack("<Q", len(header)) + header + bytes(tensor.data), 8 + len(header)
    from safetensors.torch import save as st_save

    blob = st_save({TENSOR_NAME: tensor})
    (header_len,) = struct.unpack("<Q", blob[:8])
    return blob, 8 + header_len


_LIST_FORMATS = {
    "torch.float64": "d",
    "torch.float32": "f",
    "torch.float16": "e",
    "torch.int64": "q",
    "torch.int32": "i",
    "torch.int16": "h",
    "torch.int8": "b",
    "torch.uint8": "B",
    "torch.bool": "?",
    "torch.uint16": "H",
    "torch.uint32": "I",
    "torch.uint64": "Q",
}
"""The `struct` format of each dtype's elements (bfloat16, which has none, is widened to float32 by hand)."""


def _element_bytes(dtype: str) -> int | None:
    """Bytes per element: the stored dtypes' from `_DTYPES`, the few others' from their `struct` format."""
    if dtype in _MANIFEST_NAMES:
        return _DTYPES[_MANIFEST_NAMES[dtype]][1]
    return struct.calcsize(_LIST_FORMATS[dtype]) if dtype in _LIST_FORMATS else None


def _nested(flat: list, shape: tuple[int, ...]):
    """`flat` (C order) as nested lists of `shape`; its one value for a 0-d shape."""
    if not shape:
        return flat[0]
    if len(shape) == 1:
        return flat
    step = math.prod(shape[1:])
    return [_nested(flat[i * step : (i + 1) * step], shape[1:]) for i in range(shape[0])]


@dataclass(frozen=True)
class RawTensor:
    """A dense tensor as its bytes (C order, little-endian) with its dtype in the manifest's spelling
    (`torch.float32`) and its shape: what the capture writer process builds bundles from, without importing torch.
    It has the few tensor methods the bundle writer and the capture records call (`dim`, `numel`,
    `element_size`, `reshape`, `tolist`, `item`)."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes

    def __post_init__(self) -> None:
        # a dtype that cannot be stored is kept as it is: `check_storable` refuses it naming the payload
        object.__setattr__(self, "dtype", self.dtype if self.dtype.startswith("torch.") else f"torch.{self.dtype}")
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        size = _element_bytes(self.dtype)
        if any(d < 0 for d in self.shape) or (size is not None and len(self.data) != math.prod(self.shape) * size):
            raise BundleError(f"a {self.dtype} tensor of shape {list(self.shape)} cannot hold {len(self.data)} bytes")

    def dim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        return math.prod(self.shape)

    def element_size(self) -> int:
        size = _element_bytes(self.dtype)
        if size is None:
            raise BundleError(f"dtype {self.dtype} is not known here")
        return size

    def reshape(self, *shape: int) -> RawTensor:
        """The same bytes under another shape; one dimension may be -1."""
        dims = list(shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape)
        if dims.count(-1) == 1:
            known = math.prod(d for d in dims if d != -1)
            dims[dims.index(-1)] = self.numel() // known if known else 0
        if math.prod(dims) != self.numel():
            raise ValueError(f"shape {list(shape)} is invalid for a tensor of {self.numel()} elements")
        return RawTensor(self.dtype, tuple(dims), self.data)

    def tolist(self):
        """The values as Python numbers, nested by the shape (one number for a 0-d tensor)."""
        n = self.numel()
        if self.dtype == "torch.bfloat16":  # the high half of a float32
            wide = struct.pack(f"<{n}I", *(v << 16 for v in struct.unpack(f"<{n}H", self.data)))
            flat = list(struct.unpack(f"<{n}f", wide))
        elif self.dtype in _LIST_FORMATS:
            flat = list(struct.unpack(f"<{n}{_LIST_FORMATS[self.dtype]}", self.data))
        else:
            raise BundleError(f"dtype {self.dtype} is not known here")
        return _nested(flat, self.shape)

    def item(self):
        if self.numel() != 1:
            raise ValueError(f"only a tensor of one element has an item, not one of {self.numel()}")
        return self.reshape(-1).tolist()[0]

    @staticmethod
    def cat(parts: list[RawTensor]) -> RawTensor:
        """The flat concatenation of tensors of one dtype."""
        dtypes = {p.dtype for p in parts}
        if len(dtypes) != 1:
            raise BundleError(f"cannot join tensors of dtypes {sorted(dtypes)}")
        return RawTensor(parts[0].dtype, (sum(p.numel() for p in parts),), b"".join(bytes(p.data) for p in parts))


@dataclass(frozen=True)
class Header:
    """A checked safetensors header of a one-tensor blob."""

    code: str
    """The safetensors dtype code (`F32`)."""
    shape: tuple[int, ...]
    data_start: int
    data_end: int

    @property
    def dtype_name(self) -> str:
        """The manifest spelling of the dtype (`torch.float32`)."""
        return _DTYPES[self.code][0]

    @property
    def itemsize(self) -> int:
        return _DTYPES[self.code][1]

    @property
    def dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype_name)


def header_length(prefix: bytes | bytearray, where: str) -> int:
    """The JSON header length from the first 8 bytes of a blob, bounded."""
    if len(prefix) < 8:
        raise BundleError(f"{where}: not a safetensors blob (only {len(prefix)} bytes)")
    (n,) = struct.unpack("<Q", prefix[:8])
    if n > MAX_HEADER_BYTES:
        raise BundleError(f"{where}: safetensors header of {n} bytes is over the {MAX_HEADER_BYTES}-byte bound")
    return n


def _shape_text(shape: list) -> str:
    """A shape for messages, cut short: a hostile header may list thousands of dimensions."""
    if len(shape) <= 8:
        return str(list(shape))
    return f"[{', '.join(map(str, shape[:8]))}, … ({len(shape)} dimensions)]"


def _header_int(value: object, where: str, field: str) -> int:
    """`value` if it is a JSON integer within int64; BundleError naming the header field otherwise.

    Floats (1e400 is infinity, 8.5 is not a size) and booleans are refused rather than converted."""
    if type(value) is not int:
        raise BundleError(
            f"{where}: safetensors header field {field} holds {one_line(repr(value), 40)}, not an integer"
        )
    if not 0 <= value <= MAX_HEADER_INT:
        raise BundleError(f"{where}: safetensors header field {field} holds {value}, outside [0, 2^63)")
    return value


def parse_header(head: bytes | bytearray, blob_size: int, where: str) -> Header:
    """Check the header of a one-tensor safetensors blob of `blob_size` bytes, whose start is `head`."""
    n = header_length(head, where)
    if len(head) < 8 + n or 8 + n > blob_size:
        raise BundleError(f"{where}: safetensors header is truncated")
    text = bytes(head[8 : 8 + n])
    if nesting_exceeds(text):
        raise BundleError(f"{where}: safetensors header nests more than {MAX_JSON_DEPTH} levels deep")
    try:
        doc = json.loads(text)
    except (ValueError, UnicodeDecodeError):
        raise BundleError(f"{where}: safetensors header is not JSON") from None
    except RecursionError:  # the scan above makes this unreachable for JSON text; kept as a last guard
        raise BundleError(f"{where}: safetensors header nests too deeply") from None
    if not isinstance(doc, dict):
        raise BundleError(f"{where}: safetensors header is not an object")
    doc.pop("__metadata__", None)
    if list(doc) != [TENSOR_NAME]:
        names = sorted(doc)
        shown = one_line(repr(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else ""), QUOTE_LIMIT)
        raise BundleError(f"{where}: expected exactly one tensor named {TENSOR_NAME!r}, found {shown}")
    entry = doc[TENSOR_NAME]
    if not isinstance(entry, dict) or not all(k in entry for k in ("dtype", "shape", "data_offsets")):
        raise BundleError(
            f"{where}: malformed tensor entry in the safetensors header (needs dtype, shape and data_offsets)"
        )
    dtype_text = entry["dtype"]
    if not isinstance(dtype_text, str) or dtype_text not in _DTYPES:
        raise BundleError(
            f"{where}: malformed tensor entry in the safetensors header "
            f"(dtype {one_line(repr(dtype_text), 40)} is not one of {sorted(_DTYPES)})"
        )
    raw_shape, offsets = entry["shape"], entry["data_offsets"]
    if not isinstance(raw_shape, list):
        raise BundleError(f"{where}: safetensors header field shape is not a list")
    if len(raw_shape) > MAX_DIMS:
        raise BundleError(f"{where}: safetensors header shape has {len(raw_shape)} dimensions, more than {MAX_DIMS}")
    for i, d in enumerate(raw_shape):
        if type(d) is int and d < 0:
            raise BundleError(f"{where}: negative dimension in shape {_shape_text(raw_shape)}")
        _header_int(d, where, f"shape[{i}]")
    shape = tuple(raw_shape)
    if not isinstance(offsets, list) or len(offsets) != 2:
        raise BundleError(
            f"{where}: malformed tensor entry in the safetensors header (data_offsets is not a pair [start, end])"
        )
    itemsize = _DTYPES[dtype_text][1]
    if math.prod(max(d, 1) for d in shape) * itemsize > MAX_TENSOR_BYTES:
        raise BundleError(
            f"{where}: safetensors header shape {_shape_text(raw_shape)} of {dtype_text} is too large "
            "(its dimensions, zeros counted as ones, times its element size pass 2^62 bytes)"
        )
    start = _header_int(offsets[0], where, "data_offsets[0]")
    end = _header_int(offsets[1], where, "data_offsets[1]")
    # Python integers do not wrap, so a product of huge dimensions is compared exactly, never overflowed
    expected_bytes = math.prod(shape) * itemsize
    data_len = blob_size - 8 - n
    if start != 0 or end != data_len or end - start != expected_bytes:
        why = (
            "inverted"
            if end < start
            else "past the end of the blob"
            if end > data_len
            else "not starting at the data"
            if start != 0
            else "not covering the data"
            if end != data_len
            else "not the size of the shape"
        )
        raise BundleError(
            f"{where}: safetensors offsets [{start}, {end}) do not match {data_len} data bytes "
            f"for shape {_shape_text(raw_shape)} of {dtype_text} ({why})"
        )
    return Header(dtype_text, shape, 8 + n, blob_size)


def buffer_header(buffer: bytes | bytearray, where: str) -> Header:
    """The checked header of a whole one-tensor safetensors blob held in memory."""
    return parse_header(bytes(buffer[: 8 + header_length(bytes(buffer[:8]), where)]), len(buffer), where)


def decode_buffer(buffer: bytearray, where: str) -> torch.Tensor:
    """The tensor of a one-tensor safetensors blob held in a writable buffer, without copying the data.

    The header is checked first (the same checks as `decode`); the tensor then shares the buffer's memory."""
    import torch

    header = buffer_header(buffer, where)
    count = math.prod(header.shape)
    if count == 0:
        return torch.empty(header.shape, dtype=header.dtype)
    flat = torch.frombuffer(buffer, dtype=header.dtype, count=count, offset=header.data_start)
    return flat.reshape(header.shape)


_NUMPY_DTYPES = {
    "F64": "<f8",
    "F32": "<f4",
    "F16": "<f2",
    "I64": "<i8",
    "I32": "<i4",
    "I16": "<i2",
    "I8": "i1",
    "U8": "u1",
    "BOOL": "?",
}
"""safetensors dtype code -> numpy dtype (bfloat16 has none: it is widened to float32)."""


def decode_array(buffer: bytes | bytearray, where: str) -> tuple[Header, numpy.ndarray]:
    """The header and values of a whole one-tensor safetensors blob held in memory, without torch (validate
    checks native bundles where torch is not installed). The header is checked as `decode_buffer` checks it;
    the values share the buffer's memory, except bfloat16, which is widened exactly to float32."""
    import numpy

    header = buffer_header(buffer, where)
    count = math.prod(header.shape)
    if header.code == "BF16":  # the upper half of a float32: shift the bits into place
        raw = numpy.frombuffer(buffer, dtype="<u2", count=count, offset=header.data_start)
        values = (raw.astype("<u4") << 16).view("<f4")
    else:
        values = numpy.frombuffer(buffer, dtype=_NUMPY_DTYPES[header.code], count=count, offset=header.data_start)
    return header, values.reshape(header.shape)


def from_bytes(data: bytes, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D tensor over raw little-endian bytes (a copy, so it owns its memory)."""
    return from_buffer(bytearray(data), dtype)


def from_buffer(buffer: bytearray | memoryview, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D tensor over the raw little-endian bytes of a buffer the caller hands over (no copy: the tensor shares
    the buffer's memory)."""
    import torch

    if not buffer:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(buffer, dtype=dtype)
