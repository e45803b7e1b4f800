"""Local-disk backend. Atomicity comes from the filesystem, not from fsspec.

Every write goes to a temporary file in the destination directory, is fsynced, and is then
published with one atomic call: `os.replace` for `write`, `os.link` for `create_if_absent`
(link fails if the name exists, so exactly one of several racing writers wins and a reader
never sees a partial file). fsspec's own `mode="create"` is a check-then-write race and is
not used. A process killed at any instant leaves at most a `.tmp-*` file, which is never listed.
"""

from __future__ import annotations

import errno
import os
import stat
import uuid
from pathlib import Path

from trajectory_replay.backends.base import Backend, Capabilities, KeyStat, raise_too_large, validate_key
from trajectory_replay.errors import BackendError, IntegrityError, NotFoundError

TMP_PREFIX = ".tmp-"

_FILE_KINDS = (
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def _file_kind(mode: int) -> str:
    return next((name for test, name in _FILE_KINDS if test(mode)), "not a regular file")


class LocalBackend(Backend):
    """Keys are files under `root`."""

    capabilities = Capabilities(atomic_create=True, ranged_reads=True, listing=True, deletes=True, remote=False)
    max_workers = 4

    def __init__(self, root: str | os.PathLike, *, fsync: bool = True) -> None:
        super().__init__()
        self.root = Path(root).expanduser().absolute()
        self.url = str(self.root)
        self._dir = str(self.root)
        self.fsync = fsync
        if self.root.exists() and not self.root.is_dir():
            raise BackendError(f"{self.root}: exists and is not a directory")

    def child(self, prefix: str) -> LocalBackend:
        return LocalBackend(self.root / prefix, fsync=self.fsync)

    def _path(self, key: str) -> Path:
        return self.root / key

    def _file(self, key: str) -> str:
        """The file of `key` as a string: what the read paths open, once per chunk (a pathlib join costs several
        times the string join, and a read of a large payload opens thousands of chunk files)."""
        return os.path.join(self._dir, key)

    def local_file(self, key: str) -> str:
        """The file that holds `key` (for a helper process that reads it by path)."""
        return self._file(validate_key(key))

    def escapes_root(self, prefix: str) -> bool:
        path = self._path(prefix.rstrip("/"))
        if not os.path.lexists(path):
            return False
        real_root = os.path.realpath(self.root)
        return os.path.commonpath([real_root, os.path.realpath(path)]) != real_root

    def _open_value(self, key: str) -> tuple[int, int]:
        """(a descriptor on the regular file that holds `key`, its size). Opened without blocking and refused
        unless it is a regular file: a FIFO would block every reader until some writer came, and a device (a link
        to /dev/zero) would be read without end. A directory holds no value: NotFoundError, as an absent key."""
        try:
            fd = os.open(self._file(key), os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise NotFoundError(f"{self.url}: no such key {key!r}") from None
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            os.close(fd)
            if stat.S_ISDIR(info.st_mode):
                raise NotFoundError(f"{self.url}: {key!r} is a directory, not a value")
            raise IntegrityError(
                f"{self.url}: {key!r} is {_file_kind(info.st_mode)}, not a regular file (a store "
                "holds only regular files: remove it, or restore the file)"
            )
        return fd, info.st_size

    def _read(self, key: str) -> bytes:
        return self._read_limited(key, None)

    def _read_limited(self, key: str, limit: int | None) -> bytes:
        fd, size = self._open_value(key)
        try:
            if limit is not None and size > limit:  # refused from the file's size: not a byte of it is read
                raise_too_large(self.url, key, limit, size)
            with os.fdopen(fd, "rb", closefd=False) as f:
                # a file that grew past the bound since its size was taken is still read no further than the bound
                # (and asks for no more than its size: a read of n bytes first allocates n)
                data = f.read() if limit is None else f.read(min(size, limit) + 1)
        finally:
            os.close(fd)
        if limit is not None and len(data) > limit:
            raise_too_large(self.url, key, limit)
        return data

    def _read_into(self, key: str, target: memoryview) -> int:
        # a read of a large payload opens thousands of chunk files: a bare descriptor, no file object
        fd, size = self._open_value(key)
        try:
            if size > len(target):
                return size
            view, done = target[:size], 0
            while done < size:
                n = os.readv(fd, [view[done:]])
                if not n:
                    break
                done += n
            return done
        finally:
            os.close(fd)

    def _read_range(self, key: str, start: int, end: int) -> bytes:
        fd, _ = self._open_value(key)
        try:
            parts, at = [], start
            while at < end:  # one pread returns at most about 2 GiB
                part = os.pread(fd, end - at, at)
                if not part:
                    break
                parts.append(part)
                at += len(part)
            return b"".join(parts)
        finally:
            os.close(fd)

    def _temp_file(self, key: str, data, durable: bool = True) -> Path:
        """Write `data` to a fresh temporary file beside `key` and make it durable."""
        final = self._path(key)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / f"{TMP_PREFIX}{final.name}.{uuid.uuid4().hex[:12]}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(data).cast("B")
            while view:
                written = os.write(fd, view)
                view = view[written:]
            if self.fsync and durable:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        os.close(fd)
        return tmp

    def _write(self, key: str, data, durable: bool = True) -> None:
        tmp = self._temp_file(key, data, durable)
        try:
            os.replace(tmp, self._path(key))
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def _create(self, key: str, data) -> bool:
        tmp = self._temp_file(key, data)
        try:
            os.link(tmp, self._path(key))
            return True
        except FileExistsError:
            return False
        except OSError as exc:
            if exc.errno in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
                raise BackendError(
                    f"{self.url}: hard links are not supported here ({exc.strerror}); "
                    "create-if-absent cannot be made atomic"
                ) from None
            raise
        finally:
            tmp.unlink(missing_ok=True)

    def _exists(self, key: str) -> bool:
        # a FIFO or a device at a key is something there (reading it is refused, naming it), not an absent key
        # that every listing would pass over in silence; only a directory holds no value
        try:
            return not stat.S_ISDIR(os.stat(self._file(key)).st_mode)
        except OSError as exc:  # as Path.is_file: absent is False, anything else (a permission) is an error
            if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.EBADF, errno.ELOOP):
                return False
            raise

    def _stat(self, key: str) -> os.stat_result:
        try:
            return os.stat(self._file(key))
        except (FileNotFoundError, NotADirectoryError):
            raise NotFoundError(f"{self.url}: no such key {key!r}") from None

    def _size(self, key: str) -> int:
        return self._stat(key).st_size

    def _mtime(self, key: str) -> float:
        return self._stat(key).st_mtime

    def _size_and_mtime(self, key: str) -> KeyStat:
        found = self._stat(key)
        return KeyStat(found.st_size, found.st_mtime)

    def _list(self, prefix: str) -> list[str]:
        base = self.root / prefix if prefix else self.root
        if prefix.endswith("/") and not base.is_dir():
            return []  # a directory prefix that does not exist holds nothing (never walk its parent)
        # a prefix may name a directory ("objects/") or a partial name ("objects/ab")
        start = base if base.is_dir() else base.parent
        if not start.is_dir() or self.escapes_root(os.path.relpath(start, self.root)):
            return []  # a directory linked out of the root holds no keys of this root
        out = []
        for dirpath, _dirs, files in os.walk(start):  # os.walk does not enter linked subdirectories
            rel_dir = os.path.relpath(dirpath, self.root)
            for name in files:
                if name.startswith(TMP_PREFIX) or os.path.islink(os.path.join(dirpath, name)):
                    continue
                key = name if rel_dir == "." else f"{rel_dir}/{name}".replace(os.sep, "/")
                if key.startswith(prefix):
                    out.append(key)
        return out

    def _delete(self, key: str) -> None:
        if self.escapes_root(os.path.dirname(key)):
            raise BackendError(f"{self.url}: refusing to delete {key!r}: its directory links out of the root")
        try:
            os.unlink(self._path(key))
        except (FileNotFoundError, NotADirectoryError):
            pass

    def leftover_temporaries(self, older_than: float) -> list[str]:
        out = []
        for dirpath, _dirs, files in os.walk(self.root):  # os.walk does not enter linked subdirectories
            for name in files:
                if not name.startswith(TMP_PREFIX):
                    continue
                path = os.path.join(dirpath, name)
                try:
                    info = os.lstat(path)
                except FileNotFoundError:  # linked or removed by its writer meanwhile
                    continue
                if stat.S_ISREG(info.st_mode) and info.st_mtime < older_than:
                    out.append(os.path.relpath(path, self.root).replace(os.sep, "/"))
        return sorted(out)

    def remove_temporary(self, path: str) -> None:
        if not os.path.basename(path).startswith(TMP_PREFIX):
            raise BackendError(f"{self.url}: refusing to remove {path!r}: not a temporary file of this store")
        if self.escapes_root(os.path.dirname(path)):
            raise BackendError(f"{self.url}: refusing to remove {path!r}: its directory links out of the root")
        try:
            os.unlink(self.root / path)
        except (FileNotFoundError, NotADirectoryError):
            pass

    def _list_dir(self, prefix: str) -> list[str]:
        try:
            return [n for n in os.listdir(self.root / prefix if prefix else self.root) if not n.startswith(TMP_PREFIX)]
        except (FileNotFoundError, NotADirectoryError):
            return []
