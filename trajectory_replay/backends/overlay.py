"""A dry run over a real store: reads see the store, writes stay in memory and vanish with the overlay.

An operation that may be refused only at its end (a bundle written onto an existing name) runs here
first: it finds what the store already holds exactly as it would for real, so its outcome is the real
one, and a refusal leaves nothing in the store (no object, no in-flight record).
"""

from __future__ import annotations

import uuid

from trajectory_replay.backends.base import Backend, Capabilities, KeyStat
from trajectory_replay.backends.memory import MemoryBackend
from trajectory_replay.errors import NotFoundError


class OverlayBackend(Backend):
    """`base` for reading, a private memory store on top of it for writing. Deleting only deletes written keys."""

    capabilities = Capabilities(atomic_create=True, ranged_reads=True, listing=True, deletes=True, remote=False)

    def __init__(self, base: Backend) -> None:
        self.base = base  # before the base class sizes the pool after it
        self.max_workers = base.max_workers
        super().__init__()
        self.top = MemoryBackend(f".overlay-{uuid.uuid4().hex}")
        self.url = base.url

    @property
    def reads_are_cpu_work(self) -> bool:
        return self.base.reads_are_cpu_work

    def close(self) -> None:
        """Drop everything written."""
        try:
            self.top.fs.rm(self.top.root, recursive=True)
        except FileNotFoundError:
            pass

    def __enter__(self) -> OverlayBackend:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _read(self, key: str) -> bytes:
        try:
            return self.top._read(key)
        except NotFoundError:
            return self.base.read(key)

    def _read_range(self, key: str, start: int, end: int) -> bytes:
        if self.top._exists(key):
            return self.top._read_range(key, start, end)
        return self.base.read_range(key, start, end)

    def _write(self, key: str, data, durable: bool = True) -> None:
        self.top._write(key, data, durable)

    def _create(self, key: str, data) -> bool:
        if self.base.exists(key):
            return False
        return self.top._create(key, data)

    def _exists(self, key: str) -> bool:
        return self.top._exists(key) or self.base.exists(key)

    def _size(self, key: str) -> int:
        return self.top._size(key) if self.top._exists(key) else self.base.size(key)

    def _mtime(self, key: str) -> float:
        return self.top._mtime(key) if self.top._exists(key) else self.base.mtime(key)

    def _size_and_mtime(self, key: str) -> KeyStat:
        return self.top._size_and_mtime(key) if self.top._exists(key) else self.base.stat(key)

    def _list(self, prefix: str) -> list[str]:
        return sorted(set(self.top._list(prefix)) | set(self.base.list(prefix)))

    def _delete(self, key: str) -> None:
        self.top._delete(key)

    def _list_dir(self, prefix: str) -> list[str]:
        return sorted(set(self.top._list_dir(prefix)) | set(self.base.list_dir(prefix)))

    def probe_scope(self) -> tuple:
        return (type(self).__name__, self.top.url)


__all__ = ["OverlayBackend"]
