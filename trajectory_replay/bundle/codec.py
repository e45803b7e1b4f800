"""The tensor codec: one tensor per safetensors blob, under the name `data`. No pickle anywhere.

Headers are parsed and checked (size bound, one tensor, known dtype, offsets that exactly
cover the data, shape consistent with the byte count) before a byte of tensor data is
allocated or trusted. Row reads use the header to turn sample token offsets into byte
ranges of the blob.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass

import torch
from safetensors.torch import save as st_save

from trajectory_replay.errors import BundleError

TENSOR_NAME = "data"
MAX_HEADER_BYTES = 1 << 20
"""A header is one small JSON object; anything larger is refused before it is read."""

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
_TORCH_NAMES = {v: k for k, v in _DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The manifest spelling of a dtype (`torch.float32`), shared with the older format."""
    return str(dtype)


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a manifest dtype string; BundleError for an unknown one."""
    for dt in _TORCH_NAMES:
        if str(dt) == name or str(dt).removeprefix("torch.") == name:
            return dt
    raise BundleError(f"unsupported dtype {name!r}")


def check_storable(name: str, tensor: object) -> torch.Tensor:
    """The tensor, contiguous on the CPU, if it can be stored; BundleError naming the payload otherwise."""
    if not isinstance(tensor, torch.Tensor):
        raise BundleError(f"payload {name!r}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in _TORCH_NAMES:
        raise BundleError(f"payload {name!r}: dtype {tensor.dtype} cannot be stored")
    if tensor.is_sparse or tensor.layout != torch.strided:
        raise BundleError(f"payload {name!r}: only dense tensors can be stored")
    return tensor.detach().to("cpu").contiguous()


def encode(tensor: torch.Tensor) -> tuple[bytes, int]:
    """(safetensors bytes, offset where the tensor data starts)."""
    blob = st_save({TENSOR_NAME: tensor})
    (header_len,) = struct.unpack("<Q", blob[:8])
    return blob, 8 + header_len


@dataclass(frozen=True)
class Header:
    """A checked safetensors header of a one-tensor blob."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    data_start: int
    data_end: int

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()


def header_length(prefix: bytes, where: str) -> int:
    """The JSON header length from the first 8 bytes of a blob, bounded."""
    if len(prefix) < 8:
        raise BundleError(f"{where}: not a safetensors blob (only {len(prefix)} bytes)")
    (n,) = struct.unpack("<Q", prefix[:8])
    if n > MAX_HEADER_BYTES:
        raise BundleError(f"{where}: safetensors header of {n} bytes is over the {MAX_HEADER_BYTES}-byte bound")
    return n


def parse_header(head: bytes, blob_size: int, where: str) -> Header:
    """Check the header of a one-tensor safetensors blob of `blob_size` bytes, whose start is `head`."""
    n = header_length(head, where)
    if len(head) < 8 + n or 8 + n > blob_size:
        raise BundleError(f"{where}: safetensors header is truncated")
    try:
        doc = json.loads(bytes(head[8:8 + n]))
    except (ValueError, UnicodeDecodeError):
        raise BundleError(f"{where}: safetensors header is not JSON") from None
    if not isinstance(doc, dict):
        raise BundleError(f"{where}: safetensors header is not an object")
    doc.pop("__metadata__", None)
    if list(doc) != [TENSOR_NAME]:
        raise BundleError(f"{where}: expected exactly one tensor named {TENSOR_NAME!r}, found {sorted(doc)}")
    entry = doc[TENSOR_NAME]
    try:
        dtype = _DTYPES[entry["dtype"]]
        shape = tuple(int(d) for d in entry["shape"])
        start, end = (int(x) for x in entry["data_offsets"])
    except (KeyError, TypeError, ValueError):
        raise BundleError(f"{where}: malformed tensor entry in the safetensors header") from None
    if any(d < 0 for d in shape):
        raise BundleError(f"{where}: negative dimension in shape {list(shape)}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    expected_bytes = math.prod(shape) * itemsize
    data_len = blob_size - 8 - n
    if start != 0 or end != data_len or end - start != expected_bytes:
        raise BundleError(f"{where}: safetensors offsets [{start}, {end}) do not match {data_len} data bytes "
                          f"for shape {list(shape)} of {entry['dtype']}")
    return Header(dtype, shape, 8 + n, blob_size)


def decode_buffer(buffer: bytearray, where: str) -> torch.Tensor:
    """The tensor of a one-tensor safetensors blob held in a writable buffer, without copying the data.

    The header is checked first (the same checks as `decode`); the tensor then shares the buffer's memory."""
    header = parse_header(bytes(buffer[:8 + header_length(bytes(buffer[:8]), where)]), len(buffer), where)
    count = math.prod(header.shape)
    if count == 0:
        return torch.empty(header.shape, dtype=header.dtype)
    flat = torch.frombuffer(buffer, dtype=header.dtype, count=count, offset=header.data_start)
    return flat.reshape(header.shape)


def from_bytes(data: bytes, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D tensor over raw little-endian bytes (a copy, so it owns its memory)."""
    if not data:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=dtype)
