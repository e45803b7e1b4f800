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

from trajectory_replay.bundle.documents import MAX_JSON_DEPTH, nesting_exceeds, one_line
from trajectory_replay.errors import BundleError

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
MAX_ELEMENTS = 1 << 62
"""Bound on the product of a shape's dimensions, zeros counted as ones: past it torch cannot describe the
tensor even when it is empty (a zero dimension would otherwise let the others be anything)."""

_DTYPES: dict[str, tuple[str, int]] = {
    "F64": ("torch.float64", 8), "F32": ("torch.float32", 4), "F16": ("torch.float16", 2),
    "BF16": ("torch.bfloat16", 2), "I64": ("torch.int64", 8), "I32": ("torch.int32", 4),
    "I16": ("torch.int16", 2), "I8": ("torch.int8", 1), "U8": ("torch.uint8", 1), "BOOL": ("torch.bool", 1),
}
"""safetensors dtype code -> (the manifest's spelling of the dtype, bytes per element)."""
_MANIFEST_NAMES = {name: code for code, (name, _) in _DTYPES.items()}


def dtype_name(dtype: "torch.dtype") -> str:
    """The manifest spelling of a dtype (`torch.float32`), shared with the older format."""
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


def torch_dtype(name: str) -> "torch.dtype":
    """The torch dtype for a manifest dtype string; BundleError for an unknown one."""
    import torch

    return getattr(torch, manifest_dtype(name).removeprefix("torch."))


def check_storable(name: str, tensor: object) -> "torch.Tensor":
    """The tensor, contiguous on the CPU, if it can be stored; BundleError naming the payload otherwise."""
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise BundleError(f"payload {name!r}: expected a torch.Tensor, got {type(tensor).__name__}")
    if str(tensor.dtype) not in _MANIFEST_NAMES:
        raise BundleError(f"payload {name!r}: dtype {tensor.dtype} cannot be stored")
    if tensor.is_sparse or tensor.layout != torch.strided:
        raise BundleError(f"payload {name!r}: only dense tensors can be stored")
    return tensor.detach().to("cpu").contiguous()


def encode(tensor: "torch.Tensor") -> tuple[bytes, int]:
    """(safetensors bytes, offset where the tensor data starts)."""
    from safetensors.torch import save as st_save

    blob = st_save({TENSOR_NAME: tensor})
    (header_len,) = struct.unpack("<Q", blob[:8])
    return blob, 8 + header_len


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
    def dtype(self) -> "torch.dtype":
        return torch_dtype(self.dtype_name)


def header_length(prefix: bytes, where: str) -> int:
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
        raise BundleError(f"{where}: safetensors header field {field} holds {one_line(repr(value), 40)}, "
                          "not an integer")
    if not 0 <= value <= MAX_HEADER_INT:
        raise BundleError(f"{where}: safetensors header field {field} holds {value}, outside [0, 2^63)")
    return value


def parse_header(head: bytes, blob_size: int, where: str) -> Header:
    """Check the header of a one-tensor safetensors blob of `blob_size` bytes, whose start is `head`."""
    n = header_length(head, where)
    if len(head) < 8 + n or 8 + n > blob_size:
        raise BundleError(f"{where}: safetensors header is truncated")
    text = bytes(head[8:8 + n])
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
        shown = one_line(repr(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else ""))
        raise BundleError(f"{where}: expected exactly one tensor named {TENSOR_NAME!r}, found {shown}")
    entry = doc[TENSOR_NAME]
    if not isinstance(entry, dict) or not all(k in entry for k in ("dtype", "shape", "data_offsets")):
        raise BundleError(f"{where}: malformed tensor entry in the safetensors header "
                          "(needs dtype, shape and data_offsets)")
    dtype_text = entry["dtype"]
    if not isinstance(dtype_text, str) or dtype_text not in _DTYPES:
        raise BundleError(f"{where}: malformed tensor entry in the safetensors header "
                          f"(dtype {one_line(repr(dtype_text), 40)} is not one of {sorted(_DTYPES)})")
    raw_shape, offsets = entry["shape"], entry["data_offsets"]
    if not isinstance(raw_shape, list):
        raise BundleError(f"{where}: safetensors header field shape is not a list")
    if len(raw_shape) > MAX_DIMS:
        raise BundleError(f"{where}: safetensors header shape has {len(raw_shape)} dimensions, more than "
                          f"{MAX_DIMS}")
    for i, d in enumerate(raw_shape):
        if type(d) is int and d < 0:
            raise BundleError(f"{where}: negative dimension in shape {_shape_text(raw_shape)}")
        _header_int(d, where, f"shape[{i}]")
    shape = tuple(raw_shape)
    if not isinstance(offsets, list) or len(offsets) != 2:
        raise BundleError(f"{where}: malformed tensor entry in the safetensors header "
                          "(data_offsets is not a pair [start, end])")
    if math.prod(max(d, 1) for d in shape) > MAX_ELEMENTS:
        raise BundleError(f"{where}: safetensors header shape {_shape_text(raw_shape)} is too large "
                          "(its dimensions multiply past 2^62)")
    start = _header_int(offsets[0], where, "data_offsets[0]")
    end = _header_int(offsets[1], where, "data_offsets[1]")
    itemsize = _DTYPES[dtype_text][1]
    # Python integers do not wrap, so a product of huge dimensions is compared exactly, never overflowed
    expected_bytes = math.prod(shape) * itemsize
    data_len = blob_size - 8 - n
    if start != 0 or end != data_len or end - start != expected_bytes:
        why = ("inverted" if end < start else "past the end of the blob" if end > data_len
               else "not starting at the data" if start != 0 else "not covering the data" if end != data_len
               else "not the size of the shape")
        raise BundleError(f"{where}: safetensors offsets [{start}, {end}) do not match {data_len} data bytes "
                          f"for shape {_shape_text(raw_shape)} of {dtype_text} ({why})")
    return Header(dtype_text, shape, 8 + n, blob_size)


def buffer_header(buffer: bytes | bytearray, where: str) -> Header:
    """The checked header of a whole one-tensor safetensors blob held in memory."""
    return parse_header(bytes(buffer[:8 + header_length(bytes(buffer[:8]), where)]), len(buffer), where)


def decode_buffer(buffer: bytearray, where: str) -> "torch.Tensor":
    """The tensor of a one-tensor safetensors blob held in a writable buffer, without copying the data.

    The header is checked first (the same checks as `decode`); the tensor then shares the buffer's memory."""
    import torch

    header = buffer_header(buffer, where)
    count = math.prod(header.shape)
    if count == 0:
        return torch.empty(header.shape, dtype=header.dtype)
    flat = torch.frombuffer(buffer, dtype=header.dtype, count=count, offset=header.data_start)
    return flat.reshape(header.shape)


_NUMPY_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1",
                 "U8": "u1", "BOOL": "?"}
"""safetensors dtype code -> numpy dtype (bfloat16 has none: it is widened to float32)."""


def decode_array(buffer: bytes | bytearray, where: str) -> tuple[Header, "numpy.ndarray"]:
    """The header and values of a whole one-tensor safetensors blob held in memory, without torch (validate
    checks native bundles where torch is not installed). The header is checked as `decode_buffer` checks it;
    the values share the buffer's memory, except bfloat16, which is widened exactly to float32."""
    import numpy

    header = buffer_header(buffer, where)
    count = math.prod(header.shape)
    if header.code == "BF16":   # the upper half of a float32: shift the bits into place
        raw = numpy.frombuffer(buffer, dtype="<u2", count=count, offset=header.data_start)
        values = (raw.astype("<u4") << 16).view("<f4")
    else:
        values = numpy.frombuffer(buffer, dtype=_NUMPY_DTYPES[header.code], count=count, offset=header.data_start)
    return header, values.reshape(header.shape)


def from_bytes(data: bytes, dtype: "torch.dtype") -> "torch.Tensor":
    """A 1-D tensor over raw little-endian bytes (a copy, so it owns its memory)."""
    return from_buffer(bytearray(data), dtype)


def from_buffer(buffer: bytearray, dtype: "torch.dtype") -> "torch.Tensor":
    """A 1-D tensor over the raw little-endian bytes of a buffer the caller hands over (no copy: the tensor shares
    the buffer's memory)."""
    import torch

    if not buffer:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(buffer, dtype=dtype)
