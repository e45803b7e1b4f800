"""torchsave.encode_pt: files torch.load reads back as the tensor the bytes describe, written without torch."""

from __future__ import annotations

import io
import json
import math
import pickle
import random
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from torch.utils.serialization import config as torch_config

from trajectory_replay.bundle import codec, torchsave
from trajectory_replay.bundle.torchsave import encode_pt, raw_tensor
from trajectory_replay.errors import BundleError

REPO = Path(__file__).resolve().parents[2]
DTYPES = [name for name, _ in codec._DTYPES.values()]
SHAPES = [(), (0,), (0, 3), (3, 0), (1,), (5,), (2, 3), (2, 1, 4), (300,), (70000,)]


def _data(dtype: str, shape: tuple[int, ...], seed: int = 0) -> bytes:
    """Random bytes for a tensor (every bit pattern, NaNs included); booleans hold only 0 and 1."""
    rng = random.Random(f"{dtype}{shape}{seed}")
    count = math.prod(shape)
    if dtype == "torch.bool":
        return bytes(rng.randrange(2) for _ in range(count))
    return rng.randbytes(count * codec.itemsize(dtype))


def _expected(data: bytes, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The tensor torch itself builds from the same bytes."""
    dt = codec.torch_dtype(dtype)
    if not data:
        return torch.empty(shape, dtype=dt)
    return torch.frombuffer(bytearray(data), dtype=dt).reshape(shape)


def _load_stream(blob: bytes, tmp_path: Path) -> torch.Tensor:
    return torch.load(io.BytesIO(blob), weights_only=True)


def _load_file(blob: bytes, tmp_path: Path) -> torch.Tensor:
    path = tmp_path / "p.pt"
    path.write_bytes(blob)
    return torch.load(path, weights_only=True)


def _load_mmap(blob: bytes, tmp_path: Path) -> torch.Tensor:
    path = tmp_path / "p.pt"
    path.write_bytes(blob)
    return torch.load(path, weights_only=True, mmap=True)


def _load_mmap_computed_offsets(blob: bytes, tmp_path: Path) -> torch.Tensor:
    """torch finds the storage from the offsets it computes, and asserts them against the zip's own."""
    path = tmp_path / "p.pt"
    path.write_bytes(blob)
    saved = torch_config.load.calculate_storage_offsets
    torch_config.load.calculate_storage_offsets = True
    try:
        return torch.load(path, weights_only=True, mmap=True)
    finally:
        torch_config.load.calculate_storage_offsets = saved


def _load_full_unpickler(blob: bytes, tmp_path: Path) -> torch.Tensor:
    """The unrestricted loader, as torch loaded files before weights_only existed."""
    return torch.load(io.BytesIO(blob), weights_only=False)


LOADERS = [_load_stream, _load_file, _load_mmap, _load_mmap_computed_offsets, _load_full_unpickler]


def _assert_same(loaded: object, expected: torch.Tensor) -> None:
    assert type(loaded) is torch.Tensor and loaded.layout == torch.strided and loaded.device.type == "cpu"
    assert loaded.dtype == expected.dtype and loaded.shape == expected.shape
    assert loaded.is_contiguous() and loaded.stride() == expected.contiguous().stride()
    # bit for bit (a NaN is not equal to itself)
    assert loaded.reshape(-1).view(torch.uint8).tolist() == expected.reshape(-1).view(torch.uint8).tolist()


def test_dtype_tables_agree():
    assert set(torchsave._STORAGE_CLASSES) == set(DTYPES)
    for name in DTYPES:
        assert codec.itemsize(name) == torch.empty(0, dtype=codec.torch_dtype(name)).element_size()


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_dtype_and_shape_loads_back_through_every_path(dtype, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_SERIALIZATION_DEBUG", "1")  # the computed-offsets path checks itself
    for shape in SHAPES:
        data = _data(dtype, shape)
        blob = encode_pt(data, dtype, shape)
        expected = _expected(data, dtype, shape)
        for load in LOADERS:
            _assert_same(load(blob, tmp_path), expected)


def test_sizes_past_32_bits_are_pickled_as_long_integers(tmp_path):
    shape = (0, 3_000_000_000)
    blob = encode_pt(b"", "torch.float32", shape)
    for load in LOADERS:
        loaded = load(blob, tmp_path)
        assert loaded.shape == shape and loaded.stride() == (3_000_000_000, 1)


def test_short_dtype_names_and_memoryviews_are_accepted():
    data = struct.pack("<3f", 1.5, -2.0, 8.25)
    blob = encode_pt(memoryview(bytearray(b"xx" + data))[2:], "float32", [3])
    assert torch.load(io.BytesIO(blob), weights_only=True).tolist() == [1.5, -2.0, 8.25]


class _Recorder(pickle.Unpickler):
    """Unpickles without torch: globals become their dotted names, calls become (name, args) tuples."""

    def find_class(self, module: str, name: str):
        dotted = f"{module}.{name}"
        if dotted.endswith("Storage"):
            return dotted
        return lambda *args: (dotted, args)

    def persistent_load(self, pid):
        return ("persistent", pid)


def _entries(blob: bytes) -> dict[str, tuple[int, bytes]]:
    """{entry name: (offset of its data in the file, its data)}, from the zip's own headers."""
    out = {}
    with zipfile.ZipFile(io.BytesIO(blob)) as z:
        assert z.testzip() is None  # every CRC checks
        for info in z.infolist():
            assert info.compress_type == zipfile.ZIP_STORED
            name_len, extra_len = struct.unpack("<HH", blob[info.header_offset + 26 : info.header_offset + 30])
            out[info.filename] = (info.header_offset + 30 + name_len + extra_len, z.read(info))
    return out


@pytest.mark.parametrize(
    "tensor",
    [
        torch.arange(6, dtype=torch.float32).reshape(2, 3),
        torch.tensor(2.5, dtype=torch.float64),
        torch.empty(3, 0, dtype=torch.bool),
        torch.arange(70000, dtype=torch.int64) % 251,
        torch.ones(2, 1, 4, dtype=torch.bfloat16),
    ],
    ids=lambda t: f"{t.dtype}{list(t.shape)}",
)
def test_the_file_is_what_torch_save_writes(tensor):
    ours = encode_pt(*raw_tensor(tensor))
    theirs_buffer = io.BytesIO()
    torch.save(tensor, theirs_buffer)
    ours_entries, theirs_entries = _entries(ours), _entries(theirs_buffer.getvalue())
    assert list(ours_entries) == list(theirs_entries)
    for name, (offset, data) in ours_entries.items():
        assert offset % 64 == 0, name  # torch maps storages in place: every record starts aligned
        if not name.endswith(("data.pkl", "serialization_id")):
            assert data == theirs_entries[name][1], name
    assert len(ours_entries["archive/.data/serialization_id"][1]) == 40
    ours_pickle = _Recorder(io.BytesIO(ours_entries["archive/data.pkl"][1])).load()
    theirs_pickle = _Recorder(io.BytesIO(theirs_entries["archive/data.pkl"][1])).load()
    assert ours_pickle == theirs_pickle
    assert ours_pickle[0] == "torch._utils._rebuild_tensor_v2"
    assert ours_entries["archive/data.pkl"][1][:2] == b"\x80\x02"  # protocol 2, as torch writes


def test_equal_payloads_encode_to_equal_bytes():
    data = _data("torch.float32", (5,))
    assert encode_pt(data, "torch.float32", (5,)) == encode_pt(bytes(data), "torch.float32", [5])
    assert encode_pt(data, "torch.float32", (5,)) != encode_pt(data[:-4] + b"\0\0\0\0", "torch.float32", (5,))


@pytest.mark.parametrize(
    "args, message",
    [
        ((b"\0" * 7, "torch.float32", (2,)), r"^7 bytes do not hold shape \[2\] of torch\.float32 \(8 bytes\)$"),
        ((b"", "torch.complex64", (0,)), r"^unsupported dtype 'torch.complex64'$"),
        ((b"", "torch.float32", (-1,)), r"^shape \[-1\] must list non-negative integers$"),
        ((b"\0" * 4, "torch.float32", (2.0,)), r"^shape \[2.0\] must list non-negative integers$"),
    ],
)
def test_arguments_that_describe_no_tensor_are_refused_in_one_line(args, message):
    with pytest.raises(BundleError, match=message):
        encode_pt(*args)


# Encodes the cases given as JSON ([hex bytes, dtype, shape] each) with torch unimportable and prints the
# files (hex), then whether torch got loaded.
CHILD = """
import json, sys
sys.modules["torch"] = None
from trajectory_replay.bundle.torchsave import encode_pt
cases = json.loads(sys.argv[1])
print(json.dumps([encode_pt(bytes.fromhex(d), dtype, shape).hex() for d, dtype, shape in cases]))
print(json.dumps(sys.modules.get("torch") is not None))
"""


def test_encode_pt_runs_where_torch_cannot_be_imported():
    cases = [(_data(dtype, shape), dtype, shape) for dtype in DTYPES for shape in [(), (0,), (2, 3)]]
    done = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps([(d.hex(), t, s) for d, t, s in cases])],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    files, torch_loaded = [json.loads(line) for line in done.stdout.splitlines()]
    assert torch_loaded is False
    for (data, dtype, shape), file in zip(cases, files, strict=True):
        _assert_same(torch.load(io.BytesIO(bytes.fromhex(file)), weights_only=True), _expected(data, dtype, shape))
