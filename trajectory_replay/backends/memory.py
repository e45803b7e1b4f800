"""In-memory backend over fsspec's `memory://` filesystem, for fast tests.

fsspec's memory store is one process-wide dict, so every backend opened on the same
`memory://name` sees the same keys. create_if_absent takes a process-wide lock around
check-and-write, which makes it atomic among threads (the only writers a memory store has).
"""

from __future__ import annotations

import threading
import time

import fsspec

from trajectory_replay.backends.base import Backend, Capabilities, KeyStat
from trajectory_replay.errors import NotFoundError

_CREATE_LOCK = threading.Lock()


class MemoryBackend(Backend):
    """Keys are entries of fsspec's in-memory filesystem under `/<root>`."""

    capabilities = Capabilities(atomic_create=True, ranged_reads=True, listing=True, deletes=True, remote=False)

    def __init__(self, root: str) -> None:
        super().__init__()
        self.fs = fsspec.filesystem("memory")
        self.root = "/" + root.strip("/")
        self.url = f"memory://{self.root.lstrip('/')}"

    def child(self, prefix: str) -> MemoryBackend:
        return MemoryBackend(f"{self.root}/{prefix}")

    def _path(self, key: str) -> str:
        return f"{self.root}/{key}"

    def _read(self, key: str) -> bytes:
        try:
            return self.fs.cat_file(self._path(key))
        except FileNotFoundError:
            raise NotFoundError(f"{self.url}: no such key {key!r}") from None

    def _read_range(self, key: str, start: int, end: int) -> bytes:
        try:
            return self.fs.cat_file(self._path(key), start=start, end=end)
        except FileNotFoundError:
            raise NotFoundError(f"{self.url}: no such key {key!r}") from None

    def _write(self, key: str, data, durable: bool = True) -> None:
        # pipe_file swaps in a complete new file object, so readers never see a partial value
        self.fs.pipe_file(self._path(key), bytes(data))

    def _create(self, key: str, data) -> bool:
        with _CREATE_LOCK:
            if self.fs.isfile(self._path(key)):
                return False
            self.fs.pipe_file(self._path(key), bytes(data))
            return True

    def _exists(self, key: str) -> bool:
        return self.fs.isfile(self._path(key))

    def _info(self, key: str) -> dict:
        try:
            return self.fs.info(self._path(key))
        except FileNotFoundError:
            raise NotFoundError(f"{self.url}: no such key {key!r}") from None

    def _size(self, key: str) -> int:
        return int(self._info(key)["size"])

    def _mtime(self, key: str) -> float:
        return self._size_and_mtime(key).mtime

    def _size_and_mtime(self, key: str) -> KeyStat:
        info = self._info(key)
        created = info.get("created")
        return KeyStat(int(info["size"]), created.timestamp() if created is not None else time.time())

    def _list(self, prefix: str) -> list[str]:
        base = self._path(prefix) if prefix else self.root
        start = base if self.fs.isdir(base) else base.rsplit("/", 1)[0]
        if not self.fs.exists(start):
            return []
        cut = len(self.root) + 1
        return [p[cut:] for p in self.fs.find(start) if p[cut:].startswith(prefix)]

    def _delete(self, key: str) -> None:
        try:
            self.fs.rm_file(self._path(key))
        except FileNotFoundError:
            pass

    def _list_dir(self, prefix: str) -> list[str]:
        base = self._path(prefix) if prefix else self.root
        try:
            return [p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(base, detail=False)]
        except FileNotFoundError:
            return []
