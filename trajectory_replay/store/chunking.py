"""Where a blob is cut into chunks.

Without cut points a blob is cut every `chunk_size` bytes. With cut points (the offsets
where rows start, e.g. the samples of a per-token payload) boundaries are chosen among
them by content: after a row whose fingerprint meets a size-weighted condition, once the
chunk holds at least `min_size`, and always before it would exceed `max_size`. The
decision depends only on the rows themselves, so the same run of rows inside two different
blobs (a rollout-level payload and the step-level payload that consumed part of it) falls
into the same chunks after the first boundary and is stored once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import blake3

DEFAULT_CHUNK_SIZE = 4 << 20
DEFAULT_MIN_SIZE = 32 << 10
DEFAULT_TARGET_SIZE = 128 << 10
"""Cut-point chunks average about min + target. Small enough that a step-level payload holding a
contiguous run of a rollout payload's rows (often 1 MiB or less) shares all but its two edge chunks."""
_FINGERPRINT_TAIL = 4096


@dataclass(frozen=True)
class ChunkingParams:
    """Chunking settings; part of what decides dedup, so keep them stable across writers."""

    chunk_size: int = DEFAULT_CHUNK_SIZE
    min_size: int = DEFAULT_MIN_SIZE
    target_size: int = DEFAULT_TARGET_SIZE

    def __post_init__(self) -> None:
        if not (0 < self.min_size <= self.chunk_size and self.target_size > 0):
            raise ValueError(f"invalid chunking parameters {self}")


def _fixed(start: int, end: int, size: int) -> list[int]:
    return list(range(start + size, end, size)) + [end]


def _row_fingerprint(row: memoryview) -> int:
    """A 64-bit fingerprint of a row: its length and its last bytes (enough to tell rows apart cheaply)."""
    h = blake3.blake3(len(row).to_bytes(8, "little"))
    h.update(row[-_FINGERPRINT_TAIL:])
    return int.from_bytes(h.digest(length=8), "little")


def chunk_ends(
    data,
    cuts: Sequence[int] | None = None,
    params: ChunkingParams = ChunkingParams(),
    boundaries: Sequence[int] | None = None,
) -> list[int]:
    """End offsets of the chunks of `data` (the last is len(data)); a blob of size 0 has no chunks.

    `boundaries` are offsets where a chunk must end whatever the content (e.g. where a payload's data
    starts after its header, and where each micro-batch's rows start): the bytes between two of them
    are chunked on their own, so the same run of rows is cut the same way in every blob that holds it."""
    view = memoryview(data).cast("B")
    size = len(view)
    if size == 0:
        return []
    edges = [0, *sorted({b for b in boundaries or () if 0 < b < size}), size]
    points = sorted({c for c in cuts or () if 0 < c < size})
    ends: list[int] = []
    at = 0
    for start, end in zip(edges[:-1], edges[1:]):
        inner = []
        while at < len(points) and points[at] < end:
            if points[at] > start:
                inner.append(points[at])
            at += 1
        ends.extend(_segment_ends(view, start, end, inner, params, cut_points=bool(cuts)))
    return ends


def _segment_ends(
    view: memoryview, start: int, end: int, points: list[int], params: ChunkingParams, cut_points: bool
) -> list[int]:
    """Chunk ends within [start, end): fixed-size without cut points, by row content with them."""
    if not cut_points:
        return _fixed(start, end, params.chunk_size)
    bounds = [start, *points, end]
    ends: list[int] = []
    chunk_start = start
    for row_start, row_end in zip(bounds[:-1], bounds[1:]):
        if row_end - chunk_start > params.chunk_size and row_start > chunk_start:
            ends.append(row_start)  # this row would overflow the chunk: close it before the row
            chunk_start = row_start
        if row_end - row_start > params.chunk_size:
            # an oversized row is split at fixed offsets from its own start (still content-aligned)
            ends.extend(_fixed(row_start, row_end, params.chunk_size))
            chunk_start = row_end
            continue
        length = row_end - chunk_start
        if length >= params.min_size:
            threshold = min(1.0, (row_end - row_start) / params.target_size)
            if _row_fingerprint(view[row_start:row_end]) < threshold * (1 << 64):
                ends.append(row_end)
                chunk_start = row_end
    if not ends or ends[-1] != end:
        ends.append(end)
    return ends
