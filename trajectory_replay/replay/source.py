"""What replay needs from a bundle, as a protocol: replay computes over tensors and knows nothing of storage.

`bundle.BundleReader` (native store) and `bundle.legacy.LegacyBundle` (older directory format)
both satisfy it. A multi-rank bundle is handed to replay as one source per rank. A source may also offer
`reading_ahead(capacity)`, a context within which it reads as suits a thread that reads ahead of the kernels
(`reading_ahead` below); how it then reads is the source's business.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from trajectory_replay.bundle.schema import BundleIndex, Manifest, SampleRecord

if TYPE_CHECKING:  # only named in annotations: validate imports this module where torch is not installed
    import torch


@runtime_checkable
class ReplaySource(Protocol):
    """One bundle (or one rank of a multi-rank bundle) as replay sees it."""

    bundle_id: str
    manifest: Manifest
    index: BundleIndex
    expected: dict[str, Any]
    """expected.json as stored (stage name -> {field: value or list}); values may be NaN."""
    rank: int | None
    """The producer rank this source is, or None for a single-producer bundle."""

    def has_payload(self, name: str) -> bool:
        """True when the bundle holds the per-token payload `name` (`loss_mask` always exists)."""
        ...

    def load_payload(self, name: str, samples: Sequence[int] | None = None) -> torch.Tensor:
        """The flat per-token tensor `name`; with `samples` (positions in index order), only their rows,
        concatenated in the order given. `loss_mask` is a uint8 per-token payload. Raises BundleError
        when the payload is missing or does not match its declared dtype/shape."""
        ...


@contextmanager
def reading_ahead(sources: Sequence[ReplaySource], capacity: int) -> Iterator[None]:
    """Within it, the payload rows of `sources` are read on a thread of their own, ahead of the kernels, about
    `capacity` bytes of them in use at a time: each source that offers `reading_ahead` reads as it then sees fit (a
    native bundle on local disk: through a reading process); the others read as they always do."""
    with ExitStack() as stack:
        for source in {id(s): s for s in sources}.values():
            enter = getattr(source, "reading_ahead", None)
            if enter is not None:
                stack.enter_context(enter(capacity))
        yield


@dataclass(frozen=True)
class SamplesById:
    """The samples of a bundle's sources (one per rank) by id: where each is, its record, and its payload rows.
    What compares bundles sample by sample whatever their order and sharding (diff, the chain's link) works on."""

    sources: Sequence[ReplaySource]
    where: dict[str, tuple[int, int]]
    """sample id -> (source index, position in that source); the first occurrence of an id."""

    @classmethod
    def of(cls, sources: Sequence[ReplaySource]) -> SamplesById:
        where: dict[str, tuple[int, int]] = {}
        for k, source in enumerate(sources):
            for i, r in enumerate(source.index.samples):
                where.setdefault(r.sample_id, (k, i))
        return cls(sources, where)

    def record(self, sample_id: str) -> SampleRecord:
        k, i = self.where[sample_id]
        return self.sources[k].index.samples[i]

    def has_payload(self, name: str) -> bool:
        return all(s.has_payload(name) for s in self.sources)

    def rows(self, name: str, ids: Sequence[str]) -> dict[str, torch.Tensor]:
        """Each sample's rows of payload `name` (fetched per source, only the rows asked for)."""
        out: dict[str, torch.Tensor] = {}
        for k, source in enumerate(self.sources):
            mine = [sid for sid in ids if self.where[sid][0] == k]
            if not mine:
                continue
            positions = [self.where[sid][1] for sid in mine]
            flat = source.load_payload(name, samples=positions).reshape(-1)
            lengths = [max(source.index.samples[p].response_length, 0) for p in positions]
            out.update(zip(mine, flat.split(lengths)))
        return out
