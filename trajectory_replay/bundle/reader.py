"""BundleReader: open a bundle by path or URL, verify COMPLETE -> documents -> records, load tensors lazily.

A whole payload is fetched and verified chunk by chunk; the rows of chosen samples are
fetched with verified ranged reads of just the blocks that hold them. Nothing beyond what is
asked is fetched, and remote reads go through the store's cache. A bundle without its final
COMPLETE does not exist here (`inspect` reports such bundles); if every rank marker is there
and they agree, the reader finalizes it first (the last rank died after landing).

The index is served as stored: loss masks live in the per-token `loss_mask` payload and the
records' `loss_mask` lists are empty (`full_index()` restores them). Replay reads masks from
the payload, so a partial selection never has to fetch every sample's mask.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel

from trajectory_replay.backends import redact_url
from trajectory_replay.bundle import codec
from trajectory_replay.bundle.anchor import Anchor
from trajectory_replay.bundle.documents import check_document_size, parse_document, parse_json, validate_document
from trajectory_replay.bundle.markers import CompleteMarker, DocRef, Documents, read_complete
from trajectory_replay.bundle.paths import split_bundle_path
from trajectory_replay.bundle.schema import BundleIndex, Expected, Manifest, PayloadSpec
from trajectory_replay.bundle.status import bundle_status, describe_missing, finalize
from trajectory_replay.bundle.writer import LOSS_MASK
from trajectory_replay.errors import BundleError, IncompleteBundleError, TrajectoryReplayError
from trajectory_replay.store import BlobRecord, BlobRef, ObjectStore

if TYPE_CHECKING:  # tensors are built only when a payload is loaded; opening and headers need no torch
    import numpy
    import torch

_HEAD_PROBE = 4096

_M = TypeVar("_M", bound=BaseModel)


class BundleReader:
    """One bundle, or one rank of a multi-rank bundle, in a store. Satisfies `replay.source.ReplaySource`."""

    def __init__(self, store: ObjectStore, name: str, marker: CompleteMarker, rank: int | None = None) -> None:
        self.store, self.name, self.marker = store, name, marker
        self.rank = rank if marker.multi_rank else None
        self.label = f"{redact_url(store.url)}/{name}" + (f"/rank-{rank}" if self.rank is not None else "")
        self.documents: Documents = marker.documents(self.rank)
        self.manifest = self._document(self.documents.manifest, "manifest", Manifest)
        self.index = self._document(self.documents.index, "index", BundleIndex)
        expected_raw = self._json(self.documents.expected, "expected")
        validate_document(Expected, expected_raw, f"{self.label}: expected")
        self.expected: dict[str, Any] = expected_raw
        for what, value in (("manifest", self.manifest.bundle_id), ("index", self.index.bundle_id)):
            if value != marker.bundle_id:
                raise BundleError(
                    f"{self.label}: bundle_id {value!r} in the {what} differs from {marker.bundle_id!r} in COMPLETE"
                )
        if Anchor.of(self.index.identity) != marker.anchor:  # ls and --step go by the marker's: both must agree
            raise BundleError(
                f"{self.label}: corrupt COMPLETE: anchor {marker.anchor} differs from "
                f"{Anchor.of(self.index.identity)} in the index"
            )
        self._offsets = self.index.token_offsets()
        self._headers: dict[str, codec.Header] = {}
        self._records: dict[str, BlobRecord] = {}

    @property
    def bundle_id(self) -> str:
        return self.manifest.bundle_id

    def peers(self) -> list[BundleReader]:
        """Readers of the other ranks of this reader's multi-rank bundle (none for a single producer)."""
        if self.rank is None:
            return []
        return [
            BundleReader(self.store, self.name, self.marker, r)
            for r in sorted(int(k) for k in self.marker.shards)
            if r != self.rank
        ]

    @classmethod
    def open(cls, path_or_url: str | os.PathLike[str], **storage_options: Any) -> BundleReader:
        """Open a single-producer bundle, or one rank addressed as `<bundle>/rank-<r>`."""
        sources = open_native(os.fspath(path_or_url), **storage_options)
        if len(sources) != 1:
            raise BundleError(
                f"{path_or_url}: a multi-rank bundle (ranks {[s.rank for s in sources]}); "
                "address one rank as <bundle>/rank-<r>"
            )
        return sources[0]

    # ---- documents -----------------------------------------------------------------------------
    def _bytes(self, ref: DocRef, label: str) -> bytearray:
        check_document_size(ref.size, label)  # the record must agree with this size, so nothing larger is read
        try:
            return self.store.get(ref.blob_ref())
        except TrajectoryReplayError as exc:
            raise type(exc)(f"{label}: {exc}") from None

    def _json(self, ref: DocRef, what: str) -> dict[str, Any]:
        label = f"{self.label}: {what}"
        return parse_json(self._bytes(ref, label), label)

    def _document(self, ref: DocRef, what: str, model: type[_M]) -> _M:
        label = f"{self.label}: {what}"
        return parse_document(model, self._bytes(ref, label), label)

    def full_index(self) -> BundleIndex:
        """The index with every record's loss_mask restored from the `loss_mask` payload."""
        if LOSS_MASK not in self.manifest.payloads:
            return self.index
        mask = self.load_array(LOSS_MASK).tolist()  # numpy: export restores masks where torch is absent
        samples = [
            s.model_copy(update={"loss_mask": mask[a:b]})
            for s, a, b in zip(self.index.samples, self._offsets[:-1], self._offsets[1:])
        ]
        return self.index.model_copy(update={"samples": samples})

    # ---- payloads ------------------------------------------------------------------------------
    def has_payload(self, name: str) -> bool:
        """True when the bundle holds payload `name` (`loss_mask` always exists)."""
        return name in self.manifest.payloads or name == LOSS_MASK

    def spec(self, name: str) -> PayloadSpec:
        try:
            return self.manifest.payloads[name]
        except KeyError:
            raise BundleError(f"{self.label}: no payload {name!r} (has {sorted(self.manifest.payloads)})") from None

    def load_payload(self, name: str, samples: Sequence[int] | None = None) -> torch.Tensor:
        """The flat tensor `name`, or only the rows of the given sample positions (index order), verified.

        Nothing is kept: replay's own cache decides what stays loaded, so memory follows what it still needs."""
        if name == LOSS_MASK and LOSS_MASK not in self.manifest.payloads:
            return self._mask_from_records(samples)
        spec = self.spec(name)
        if samples is None:
            return self._load_whole(name, spec)
        positions = self._check_positions(samples)
        if not spec.per_token:
            return _take_rows(self._load_whole(name, spec), self._offsets, positions, self.label, name)
        with self._located(name):
            return self._load_rows(name, spec, positions)

    @contextmanager
    def _located(self, name: str) -> Iterator[None]:
        """Prefix a store error with the bundle and payload it happened in (once)."""
        where = f"{self.label}: payload {name!r}"
        try:
            yield
        except TrajectoryReplayError as exc:
            if str(exc).startswith(where):
                raise
            raise type(exc)(f"{where}: {exc}") from None

    def reading_ahead(self, capacity: int) -> AbstractContextManager[None]:
        """Within it, payload rows are read as suits a thread that reads ahead of the kernels (the store decides how:
        `ObjectStore.reading_ahead`, about `capacity` bytes in use at a time)."""
        return self.store.reading_ahead(capacity)

    def payload_ref(self, name: str) -> BlobRef:
        spec = self.spec(name)
        if spec.digest is None or spec.record is None:
            raise BundleError(f"{self.label}: payload {name!r}: no digest in the manifest")
        return BlobRef(spec.digest, spec.size, spec.record)

    def _load_whole(self, name: str, spec: PayloadSpec) -> torch.Tensor:
        where = f"{self.label}: payload {name!r}"
        tensor = codec.decode_buffer(self._whole_blob(name), where)
        _check_spec(codec.dtype_name(tensor.dtype), tuple(tensor.shape), spec, where)
        return tensor.reshape(-1)

    def load_array(self, name: str) -> numpy.ndarray:
        """Payload `name` (one the manifest lists) whole, as a flat numpy array, verified as `load_payload`
        verifies it but without torch: validate checks native bundles where torch is not installed."""
        spec, where = self.spec(name), f"{self.label}: payload {name!r}"
        header, values = codec.decode_array(self._whole_blob(name), where)
        _check_spec(header.dtype_name, header.shape, spec, where)
        return values.reshape(-1)

    def _whole_blob(self, name: str) -> bytearray:
        """The payload's blob, every chunk and the whole verified against its digests."""
        ref = self.payload_ref(name)
        with self._located(name):
            return self.store.get(ref)

    def header(self, name: str) -> codec.Header:
        """The checked safetensors header of payload `name` (fetched with one small verified ranged read)."""
        if name in self._headers:
            return self._headers[name]
        with self._located(name):
            return self._read_header(name)

    def _read_header(self, name: str) -> codec.Header:
        spec, ref = self.spec(name), self.payload_ref(name)
        where = f"{self.label}: payload {name!r}"
        record = self._record(name)
        head = self.store.read_range(ref, 0, min(spec.size, _HEAD_PROBE), record=record)
        need = 8 + codec.header_length(head, where)
        if need > len(head):
            head = self.store.read_range(ref, 0, min(spec.size, need), record=record)
        header = codec.parse_header(head, spec.size, where)
        _check_spec(header.dtype_name, header.shape, spec, where)
        self._headers[name] = header
        return header

    def _record(self, name: str) -> BlobRecord:
        if name not in self._records:
            self._records[name] = self.store.record(self.payload_ref(name))
        return self._records[name]

    def _load_rows(self, name: str, spec: PayloadSpec, positions: list[int]) -> torch.Tensor:
        header = self.header(name)
        total = self._offsets[-1]
        numel = 1
        for d in header.shape:
            numel *= d
        if numel != total:
            raise BundleError(
                f"{self.label}: payload {name!r} has {numel} elements, the index has {total} response tokens"
            )
        size, offsets, start = header.itemsize, self._offsets, header.data_start
        spans: list[tuple[int, int]] = []
        if positions and positions == list(range(positions[0], positions[-1] + 1)):  # one run of rows: one range
            spans.append((start + offsets[positions[0]] * size, start + offsets[positions[-1] + 1] * size))
        else:
            for p in positions:  # adjacent rows are one range (a block of whole groups is mostly runs of rows)
                lo, hi = start + offsets[p] * size, start + offsets[p + 1] * size
                if spans and spans[-1][1] == lo:
                    spans[-1] = (spans[-1][0], hi)
                else:
                    spans.append((lo, hi))
        # the rows' runs, joined in one buffer the tensor takes over (a part of a reading process's arena, if one is on)
        data = self.store.read_joined(self.payload_ref(name), spans, record=self._record(name), for_tensor=True)
        return codec.from_buffer(data, header.dtype)

    def row_blocks(self, name: str, positions: Sequence[int]) -> list[tuple[int, int, tuple[tuple[int, bytes], ...]]]:
        """For each sample position: the byte span of its rows in payload `name`'s blob, and the (offset, hash) of
        every block that span lies in. Reads only the blob's record and header. Two bundles whose spans and
        blocks agree hold the same bytes there (the hashes are verified content digests), which a diff then need
        not fetch."""
        header, record = self.header(name), self._record(name)
        size, block = header.itemsize, record.block_size
        starts = [c.offset for c in record.chunks]
        out = []
        for p in self._check_positions(list(positions)):
            lo = header.data_start + self._offsets[p] * size
            hi = header.data_start + self._offsets[p + 1] * size
            keys: list[tuple[int, bytes]] = []
            ci = max(bisect.bisect_right(starts, lo) - 1, 0)
            while ci < len(record.chunks) and hi > lo and record.chunks[ci].offset < hi:
                chunk = record.chunks[ci]
                first = (max(lo, chunk.offset) - chunk.offset) // block
                last = (min(hi, chunk.offset + chunk.size) - chunk.offset - 1) // block
                keys += [
                    (chunk.offset + b * block, chunk.blocks[32 * b : 32 * (b + 1)]) for b in range(first, last + 1)
                ]
                ci += 1
            out.append((lo, hi, tuple(keys)))
        return out

    def _mask_from_records(self, samples: Sequence[int] | None) -> torch.Tensor:
        import torch

        records = self.index.samples
        chosen = range(len(records)) if samples is None else self._check_positions(samples)
        flat = [v for p in chosen for v in records[p].loss_mask]
        return torch.tensor(flat, dtype=torch.uint8)

    def _check_positions(self, samples: Sequence[int]) -> list[int]:
        n = len(self.index.samples)
        out = list(samples)
        if out and all(type(p) is int for p in out) and 0 <= min(out) and max(out) < n:
            return out
        for p in out:
            if not isinstance(p, int) or not 0 <= p < n:
                raise BundleError(f"{self.label}: sample position {p!r} out of range (bundle has {n} samples)")
        return out

    def object_digests(self) -> list[str]:
        """Every blob digest this bundle references: its documents and payloads."""
        return self.documents.digests() + [s.digest for s in self.manifest.payloads.values() if s.digest]

    def __repr__(self) -> str:
        return f"BundleReader({self.label!r})"


def _check_spec(dtype: str, shape: tuple[int, ...], spec: PayloadSpec, where: str) -> None:
    """`dtype` is the manifest spelling (`torch.float32`) of what the blob holds."""
    if dtype != codec.manifest_dtype(spec.dtype):
        raise BundleError(f"{where}: dtype {dtype} does not match the manifest's {spec.dtype}")
    if list(shape) != list(spec.shape):
        raise BundleError(f"{where}: shape {list(shape)} does not match the manifest's {spec.shape}")


def _take_rows(flat: torch.Tensor, offsets: list[int], positions: list[int], label: str, name: str) -> torch.Tensor:
    import torch

    if flat.numel() != offsets[-1]:
        raise BundleError(
            f"{label}: payload {name!r} has {flat.numel()} elements, the index has {offsets[-1]} response tokens"
        )
    if not positions:
        return flat[:0].clone()
    return torch.cat([flat[offsets[p] : offsets[p + 1]] for p in positions])


# ---- opening ---------------------------------------------------------------------------------------


def open_native(path_or_url: str, *, store: ObjectStore | None = None, **storage_options: Any) -> list[BundleReader]:
    """One reader per rank of the native bundle at `path_or_url` (`<root>/<bundle>` or `.../rank-<r>`)."""
    root, name, rank = split_bundle_path(path_or_url)
    return native_readers(store or ObjectStore.open(root, **storage_options), name, rank)


def native_readers(
    store: ObjectStore, name: str, rank: int | None = None, marker: CompleteMarker | None = None
) -> list[BundleReader]:
    """One reader per rank of bundle `name` of `store` (only rank `rank`'s when given), from its COMPLETE
    (`marker` when already read); finalized first when every rank landed; IncompleteBundleError otherwise."""
    if marker is None:
        marker = read_complete(store.backend, name)
    if marker is None:
        state = bundle_status(store.backend, name)
        state = None if state is None else finalize(store.backend, state, raising=True)
        marker = None if state is None else state.complete
    if marker is None:
        where = f"{redact_url(store.url)}/{name}"
        reason = describe_missing(store.backend, name, state)
        if rank is not None:
            raise IncompleteBundleError(
                f"{where}/rank-{rank}: refused until the bundle's final COMPLETE exists ({reason})"
            )
        raise IncompleteBundleError(f"{where}: {reason}")
    if rank is not None:
        if not marker.multi_rank:
            raise BundleError(f"{redact_url(store.url)}/{name}: not a multi-rank bundle; open it without /rank-{rank}")
        marker.documents(rank)
        return [BundleReader(store, name, marker, rank)]
    if marker.multi_rank:
        return [BundleReader(store, name, marker, r) for r in sorted(int(r) for r in marker.shards)]
    return [BundleReader(store, name, marker)]


__all__ = ["BundleReader", "native_readers", "open_native"]
