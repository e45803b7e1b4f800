"""A local read cache of verified objects and blocks, keyed by their own BLAKE3 digest.

Serves remote backends only (local stores are read directly). Entries are content-addressed,
so several processes can share one cache directory: each entry is written to a temporary
file and renamed into place, and every hit is re-verified before it is returned (a damaged
entry is dropped and fetched again). The directory is kept under a byte cap by evicting
the least recently used entries.

A hit proves its bytes are the ones the digest names, not that the store still holds them: a
reader that checks the store itself (validate) opens it with `trust_cache=False`, which skips
lookups here and only adds what it fetched and verified.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from pathlib import Path

import blake3

from trajectory_replay.backends.base import BytesLike

log = logging.getLogger(__name__)

ENV_DIR = "TRAJECTORY_REPLAY_CACHE_DIR"
ENV_BYTES = "TRAJECTORY_REPLAY_CACHE_BYTES"
DEFAULT_MAX_BYTES = 8 << 30


def default_cache_dir() -> Path:
    """$TRAJECTORY_REPLAY_CACHE_DIR, else $XDG_CACHE_HOME/trajectory-replay, else ~/.cache/trajectory-replay."""
    if os.environ.get(ENV_DIR):
        return Path(os.environ[ENV_DIR]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "trajectory-replay"


def _max_bytes_from_env() -> int:
    value = os.environ.get(ENV_BYTES)
    if not value:
        return DEFAULT_MAX_BYTES
    try:
        return max(0, int(value))
    except ValueError:
        raise ValueError(f"{ENV_BYTES}={value!r}: expected a number of bytes") from None


class ReadCache:
    """Verified bytes by 64-hex BLAKE3 digest, on local disk, size-capped."""

    def __init__(self, directory: os.PathLike | str | None = None, max_bytes: int | None = None) -> None:
        self.directory = Path(directory).expanduser() if directory else default_cache_dir()
        self.max_bytes = _max_bytes_from_env() if max_bytes is None else max_bytes
        self._added = 0
        self._lock = threading.Lock()

    def _path(self, hexdigest: str) -> Path:
        return self.directory / hexdigest[:2] / hexdigest

    def get(self, hexdigest: str) -> bytes | None:
        """The cached bytes for `hexdigest` if present and intact, else None."""
        path = self._path(hexdigest)
        try:
            data = path.read_bytes()
        except OSError:
            return None
        if blake3.blake3(data).hexdigest() != hexdigest:
            log.warning("dropping damaged cache entry %s", path)
            path.unlink(missing_ok=True)
            return None
        try:
            os.utime(path)  # recency for eviction
        except OSError:
            pass
        return data

    def put(self, hexdigest: str, data: BytesLike) -> None:
        """Store verified `data` (the caller has checked it hashes to `hexdigest`)."""
        if self.max_bytes <= 0 or len(data) > self.max_bytes:
            return
        path = self._path(hexdigest)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.parent / f".tmp-{hexdigest[:8]}-{uuid.uuid4().hex[:8]}"
            tmp.write_bytes(data)
            os.replace(tmp, path)
        except OSError as exc:  # a cache that cannot be written only costs speed
            log.debug("cache write failed: %s", exc)
            return
        with self._lock:
            self._added += len(data)
            over = self._added > self.max_bytes // 8
            if over:
                self._added = 0
        if over:
            self.evict()

    def evict(self) -> None:
        """Remove least recently used entries until the cache is under 80% of its cap."""
        entries = []
        total = 0
        for sub in self.directory.glob("??"):
            for f in sub.iterdir():
                try:
                    st = f.stat()
                except OSError:
                    continue
                entries.append((st.st_mtime, st.st_size, f))
                total += st.st_size
        if total <= self.max_bytes:
            return
        entries.sort()
        limit = int(self.max_bytes * 0.8)
        for _mtime, size, f in entries:
            if total <= limit:
                break
            f.unlink(missing_ok=True)
            total -= size
