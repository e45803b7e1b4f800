"""`codec.RawTensor`: the writer process's tensors, made and encoded without torch, byte for byte as torch's."""

from __future__ import annotations

import pytest
import torch

from trajectory_replay.bundle import codec
from trajectory_replay.bundle.codec import RawTensor
from trajectory_replay.errors import BundleError


def _raw(t: torch.Tensor) -> RawTensor:
    data = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return RawTensor(str(t.dtype), tuple(t.shape), data)


CASES = [
    torch.randn(7),
    torch.randn(3, 5, dtype=torch.float64),
    torch.randn(9).to(torch.bfloat16),
    torch.randn(4).to(torch.float16),
    torch.arange(-6, 6, dtype=torch.int64).reshape(3, 4),
    torch.arange(-3, 3, dtype=torch.int32),
    torch.arange(-3, 3, dtype=torch.int16),
    torch.arange(-3, 3, dtype=torch.int8),
    torch.arange(6, dtype=torch.uint8),
    torch.tensor([True, False, True]),
    torch.empty(0),
    torch.empty(2, 0, dtype=torch.int64),
    torch.tensor(3.5),
]


@pytest.mark.parametrize("tensor", CASES, ids=lambda t: f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}")
def test_raw_tensors_encode_and_list_as_torch_tensors_do(tensor):
    raw = _raw(tensor)
    assert codec.encode(raw) == codec.encode(tensor)
    assert raw.tolist() == tensor.tolist()
    assert (raw.dim(), raw.numel(), raw.element_size()) == (tensor.dim(), tensor.numel(), tensor.element_size())
    assert raw.reshape(-1).tolist() == tensor.reshape(-1).tolist()
    blob, start = codec.encode(raw)
    assert torch.equal(codec.decode_buffer(bytearray(blob), "test"), tensor)  # and it reads back
    if tensor.numel() == 1:
        assert raw.item() == tensor.item()


def test_raw_tensors_join_reshape_and_refuse_what_torch_refuses():
    parts = [torch.arange(3, dtype=torch.int64), torch.arange(3, 7, dtype=torch.int64)]
    assert RawTensor.cat([_raw(p) for p in parts]).tolist() == torch.cat(parts).tolist()
    with pytest.raises(BundleError, match="cannot join"):
        RawTensor.cat([_raw(parts[0]), _raw(parts[1].to(torch.int32))])
    grid = _raw(torch.arange(12, dtype=torch.float32))
    assert grid.reshape(3, -1).tolist() == torch.arange(12, dtype=torch.float32).reshape(3, -1).tolist()
    with pytest.raises(ValueError, match="invalid"):
        grid.reshape(5, -1)
    with pytest.raises(ValueError, match="one element"):
        grid.item()
    with pytest.raises(BundleError, match="cannot hold 5 bytes"):
        RawTensor("float32", (2,), b"12345")
    odd = RawTensor("complex64", (1,), b"\0" * 8)  # made, so that the writer can name the payload it refuses
    with pytest.raises(BundleError, match="payload 'x': dtype torch.complex64 cannot be stored"):
        codec.check_storable("x", odd)
