"""An in-memory ReplaySource for replay tests, counting what replay loads."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from trajectory_replay.bundle.schema import BundleIndex, Manifest, PayloadSpec
from trajectory_replay.errors import BundleError
from trajectory_replay.replay.fixtures import canonical_case


class MemorySource:
    """A ReplaySource over in-memory documents and tensors; records every load_payload call.

    Like the bundle writer, it moves the records' loss_mask into a uint8 `loss_mask` payload when none is
    given, and declares every payload in the manifest (dtype, shape) unless the manifest already does.
    """

    def __init__(
        self,
        manifest: Manifest,
        index: BundleIndex,
        expected: dict[str, Any],
        payloads: dict[str, torch.Tensor],
        rank: int | None = None,
    ) -> None:
        self.payloads = dict(payloads)
        if "loss_mask" not in self.payloads:
            self.payloads["loss_mask"] = torch.tensor(
                [v for r in index.samples for v in r.loss_mask], dtype=torch.uint8
            )
        specs = dict(manifest.payloads)
        for name, tensor in self.payloads.items():
            specs.setdefault(
                name,
                PayloadSpec(
                    name=name,
                    dtype=str(tensor.dtype),
                    shape=list(tensor.shape),
                    size=tensor.numel() * tensor.element_size(),
                ),
            )
        self.manifest = manifest.model_copy(update={"payloads": specs})
        self.index = index
        self.expected = copy.deepcopy(expected)
        self.bundle_id = index.bundle_id
        self.rank = rank
        self.loads: list[tuple[str, tuple[int, ...] | None]] = []

    def has_payload(self, name: str) -> bool:
        return name in self.payloads

    def load_payload(self, name: str, samples: Sequence[int] | None = None) -> torch.Tensor:
        self.loads.append((name, None if samples is None else tuple(samples)))
        if name not in self.payloads:
            raise BundleError(f"bundle {self.bundle_id} has no payload {name!r}")
        tensor = self.payloads[name]
        if samples is None:
            return tensor.clone()
        starts, offset = [], 0
        for record in self.index.samples:
            starts.append(offset)
            offset += max(record.response_length, 0)
        lengths = [max(r.response_length, 0) for r in self.index.samples]
        return torch.cat([tensor[starts[i] : starts[i] + lengths[i]] for i in samples]) if samples else tensor[:0]

    def loaded_names(self) -> set[str]:
        """Names of every payload loaded so far."""
        return {name for name, _ in self.loads}


def source_of(case, rank: int | None = None, **payload_overrides: torch.Tensor) -> MemorySource:
    """A MemorySource of a (manifest, index, expected, payloads) case, with payloads replaced as given."""
    manifest, index, expected, payloads = case
    return MemorySource(manifest, index, expected, {**payloads, **payload_overrides}, rank=rank)


@pytest.fixture
def canonical_source():
    """Factory: a MemorySource of the canonical case."""

    def make(buggy: bool = False, current_logprob: float = 0.0) -> MemorySource:
        return source_of(canonical_case(buggy, current_logprob))

    return make
