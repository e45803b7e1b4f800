"""What replay needs from a bundle, as a protocol: replay computes over tensors and knows nothing of storage.

`bundle.BundleReader` (native store) and `bundle.legacy.LegacyBundle` (older directory format)
both satisfy it. A multi-rank bundle is handed to replay as one source per rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Protocol, Sequence, runtime_checkable

from trajectory_replay.bundle.schema import BundleIndex, Manifest

if TYPE_CHECKING:   # only named in annotations: validate imports this module where torch is not installed
    import torch


@runtime_checkable
class ReplaySource(Protocol):
    """One bundle (or one rank of a multi-rank bundle) as replay sees it."""

    bundle_id: str
    manifest: Manifest
    index: BundleIndex
    expected: dict[str, Any]
    """expected.json as stored (stage name -> {field: value or list}); values may be NaN."""
    rank: Optional[int]
    """The producer rank this source is, or None for a single-producer bundle."""

    def has_payload(self, name: str) -> bool:
        """True when the bundle holds the per-token payload `name` (`loss_mask` always exists)."""
        ...

    def load_payload(self, name: str, samples: Optional[Sequence[int]] = None) -> "torch.Tensor":
        """The flat per-token tensor `name`; with `samples` (positions in index order), only their rows,
        concatenated in the order given. `loss_mask` is a uint8 per-token payload. Raises BundleError
        when the payload is missing or does not match its declared dtype/shape."""
        ...
