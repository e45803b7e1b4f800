"""Snapshots taken on the training thread, so later in-place updates by training are harmless.

CPU tensors are copied once (a clone, or the concatenation of a per-sample list, which is already a
new tensor). CUDA tensors are copied into pinned host buffers with `non_blocking=True`, and one CUDA
event per device is recorded after the last copy; the writer thread waits on those events, so the
training thread never synchronizes with the device. Python lists are copied shallowly (their numbers
and strings are immutable; tensors inside them are snapshotted). Nothing here converts a tensor to
Python values: `.tolist()` / `float()` on a CUDA tensor would synchronize, so that happens in
`materialize_*` on the writer thread, after `Snapshot.wait()`.
"""

from __future__ import annotations

from typing import Any

import torch

_LIST_ITEM_BYTES = 8
"""Bytes counted per element of a Python list (an estimate; the bound is on tensor memory)."""


def estimate_nbytes(value: Any) -> int:
    """Bytes a snapshot of `value` will hold, computed without copying anything."""
    if value is None:
        return 0
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        total = 0
        for item in value:
            if isinstance(item, torch.Tensor):
                total += item.numel() * item.element_size()
            elif isinstance(item, (list, tuple)):
                total += _LIST_ITEM_BYTES * len(item)
            else:
                total += _LIST_ITEM_BYTES
        return total
    return _LIST_ITEM_BYTES


class Snapshot:
    """Host copies of one record's tensors, and the CUDA events that say when they are ready."""

    __slots__ = ("_devices", "events")

    def __init__(self) -> None:
        self._devices: set[torch.device] = set()
        self.events: list[Any] = []

    # ---- training thread -----------------------------------------------------------------------
    def tensor(self, t: torch.Tensor) -> torch.Tensor:
        """A private host copy of `t` (detached, contiguous)."""
        t = t.detach()
        if t.device.type == "cuda":
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            self._devices.add(t.device)
            return host
        if t.device.type != "cpu":
            return t.to("cpu")  # other accelerators: a plain (synchronous) copy
        return t.clone(memory_format=torch.contiguous_format)

    def flat(self, value: Any, what: str) -> torch.Tensor | None:
        """A per-token payload: a flat tensor, or a list of per-sample 1-D tensors (or number lists)."""
        if value is None:
            return None
        if isinstance(value, torch.Tensor):
            return self.tensor(value.reshape(-1) if value.dim() != 1 else value)
        if isinstance(value, (list, tuple)):
            if not value:
                return torch.zeros(0, dtype=torch.float32)
            if all(isinstance(v, torch.Tensor) for v in value):
                parts = [v.detach().reshape(-1) for v in value]
                if parts[0].device.type == "cuda":
                    return self.tensor(torch.cat(parts))  # one GPU operation, then one async copy
                return torch.cat([p.to("cpu") for p in parts])  # a new tensor: the one copy
            flat = (
                [x for v in value for x in (v.tolist() if isinstance(v, torch.Tensor) else v)]
                if isinstance(value[0], (list, tuple, torch.Tensor))
                else list(value)
            )
            return torch.tensor(flat, dtype=torch.float32)
        raise TypeError(f"{what}: expected a tensor or a list of per-sample tensors, got {type(value).__name__}")

    def values(self, value: Any, what: str) -> Any:
        """Per-sample values (a list, or a tensor): a shallow copy with tensors snapshotted."""
        if value is None:
            return None
        if isinstance(value, torch.Tensor):
            return self.tensor(value)
        if isinstance(value, (list, tuple)):
            return [
                self.tensor(v) if isinstance(v, torch.Tensor) else (list(v) if isinstance(v, (list, tuple)) else v)
                for v in value
            ]
        raise TypeError(f"{what}: expected a list or a tensor, got {type(value).__name__}")

    def finish(self) -> Snapshot:
        """Record one event per device after the last copy (the writer waits on them)."""
        for device in self._devices:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            self.events.append(event)
        self._devices = set()
        return self

    # ---- writer thread -------------------------------------------------------------------------
    def wait(self) -> None:
        """Block (the writer thread) until every async copy has landed."""
        for event in self.events:
            event.synchronize()
        self.events = []


__all__ = ["Snapshot", "estimate_nbytes"]
