"""The verdicts of `scan`: what one bundle's outcome holds, where it is kept in the store, and when it is trusted.

A scan keeps each outcome in the store as a **verdict**, a small JSON object written under

    <root>/.verdicts/<hex>     hex = BLAKE3 of {"bundle": digest of the bundle's COMPLETE marker,
                                                "replay": REPLAY_VERSION, "options": the scan's options}

The COMPLETE marker pins the bundle's documents by digest, and through them every payload, so the digest of
its bytes names the bundle's content: a bundle re-written with other content gets a new key, a new replay
version (a new package version or a change of replay semantics) or other options (`--atol`, `--rtol`) too.
Each verdict also holds the stamp of the bundle's objects (`object_stamps`: their keys, sizes and modification
times, taken before the replay) and an HMAC under this user's key (`verdict_secret`, kept outside the store). A
stored verdict is reused only when its MAC holds and the stamp still matches. Only outcomes that are a function
of the bundle's content are kept (`CACHEABLE`: `pass`, `diverged` and `unsupported`). `invalid` (a payload that
does not match its digest, a missing object: `fsck --repair-from` may mend it), `incomplete` and `error` are
looked at again by every scan.

The stored content has no names of hosts: concurrent scans of one root by one user write identical bytes for
one key. The `.verdicts/` prefix is a dot-name, which no command takes for a bundle.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import threading
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from dataclasses import field as dc_field
from typing import Any

from trajectory_replay import __version__
from trajectory_replay.backends import Backend
from trajectory_replay.bundle.anchor import ACTOR, Anchor
from trajectory_replay.bundle.status import BundleState
from trajectory_replay.outcome import Status
from trajectory_replay.store.cache import default_cache_dir
from trajectory_replay.store.digest import hash_bytes
from trajectory_replay.store.layout import VERDICTS_DIR

VERDICT_FORMAT = "trajectory-replay.verdict/2"
"""Version 2 holds the stamp of the bundle's objects and the scan's MAC; verdicts of version 1 are replayed."""
KEY_FILE = "scan-verdicts.key"
"""This user's key for the MAC of verdicts, in the read cache's directory (TRAJECTORY_REPLAY_CACHE_DIR)."""
SCAN_SEMANTICS = 3
"""Bumped whenever what a scan replays or how it judges changes without a package version change."""
REPLAY_VERSION = f"{__version__}+scan.{SCAN_SEMANTICS}"
"""Part of every verdict's key: a verdict of another version is not reused."""

PASS, DIVERGED, INVALID, INCOMPLETE, UNSUPPORTED = (
    Status.PASS,
    Status.DIVERGED,
    Status.INVALID,
    Status.INCOMPLETE,
    Status.UNSUPPORTED,
)
"""A bundle's verdict in the words of a replay's status."""
ERROR = "error"
"""The one verdict of a scan's own: the bundle could not be judged (its worker died on every try, storage failed
while it was replayed). The scan's status counts it as invalid."""
VERDICT_STATUSES = (PASS, DIVERGED, INVALID, INCOMPLETE, UNSUPPORTED, ERROR)
CACHEABLE = (PASS, DIVERGED, UNSUPPORTED)
"""Outcomes that depend on the bundle's content, the replay version and the options only: kept in the store."""
OUTCOME_FIELDS = ("status", "first_divergent_stage", "rank", "sample_id", "field", "token_offset", "detail")
"""The fields of a `Verdict` a stored verdict keeps: its outcome, without names, times or hosts."""


@dataclass(frozen=True)
class ScanOptions:
    """What a replay is asked for beyond the bundle itself; part of every verdict's key."""

    atol: float | None = None
    rtol: float | None = None

    def key(self) -> dict[str, Any]:
        return {"atol": self.atol, "rtol": self.rtol}


def bundle_digest(complete: bytes) -> str:
    """The digest that names a bundle's content: of its final COMPLETE marker's bytes."""
    return hash_bytes(complete)


def verdict_key(digest: str, options: ScanOptions, version: str = REPLAY_VERSION) -> str:
    """Where the verdict of the bundle whose COMPLETE hashes to `digest` is kept."""
    identity = json.dumps(
        {"bundle": digest, "replay": version, "options": options.key()}, sort_keys=True, separators=(",", ":")
    )
    return f"{VERDICTS_DIR}/{hash_bytes(identity.encode()).split(':', 1)[1]}"


@dataclass
class Verdict:
    """The outcome of one bundle."""

    name: str
    status: str
    """pass | diverged | invalid | incomplete | unsupported | error"""
    rollout_id: int | None = None
    step_id: int | None = None
    role: str = ACTOR
    """Whose step a step-level bundle's is: `actor` or `critic` (see `bundle.anchor`)."""
    digest: str | None = None
    """Digest of the COMPLETE marker replayed (None when there is none)."""
    first_divergent_stage: str | None = None
    rank: int | None = None
    """Rank of the first divergent stage, where it ran per rank."""
    sample_id: str | None = None
    field: str | None = None
    token_offset: int | None = None
    detail: str = ""
    missing_ranks: list[int] = dc_field(default_factory=list)
    expected_ranks: list[int] = dc_field(default_factory=list)
    cached: bool = False
    """Read from the store, not replayed by this scan."""
    attempts: int = 0
    seconds: float = 0.0

    @property
    def place(self) -> str:
        """Where the first divergence is, as the report and the page say it ("sample s-3, field advantages, token
        7"); empty when nothing locates it."""
        parts = (
            f"sample {self.sample_id}" if self.sample_id else "",
            f"field {self.field}" if self.field else "",
            f"token {self.token_offset}" if self.token_offset is not None else "",
            f"rank {self.rank}" if self.rank is not None else "",
        )
        return ", ".join(x for x in parts if x)

    @property
    def anchor(self) -> str | None:
        return None if self.rollout_id is None else str(Anchor(self.rollout_id, self.step_id, self.role))

    @property
    def order(self) -> tuple:
        """Anchor order: by rollout, a rollout-level bundle before the steps of its rollout, then by name;
        bundles whose anchor cannot be read last."""
        if self.rollout_id is None:
            return (1, 0, 0, self.name)
        return (0, self.rollout_id, -1 if self.step_id is None else self.step_id, self.name)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Verdict:
        """The verdict a worker answered (`to_dict()`'s fields; others, such as `anchor`, are left out)."""
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["anchor"] = self.anchor
        return out

    def outcome(self) -> dict[str, Any]:
        """What a stored verdict keeps: the outcome, without names, times or hosts (identical for every scan)."""
        return {k: getattr(self, k) for k in OUTCOME_FIELDS}


def verdict_secret() -> bytes:
    """This user's key for the MAC of verdicts: 32 random bytes in KEY_FILE, made (mode 0600) by the first scan.
    OSError when it can neither be read nor made."""
    path = default_cache_dir() / KEY_FILE
    try:
        secret = path.read_bytes()
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f".{KEY_FILE}.{os.getpid()}.{threading.get_ident()}")
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, os.urandom(32))
        finally:
            os.close(fd)
        try:
            os.link(temporary, path)  # whole or absent, and the first of concurrent scans wins
        except FileExistsError:
            pass
        finally:
            os.unlink(temporary)
        secret = path.read_bytes()
    if len(secret) < 16:
        raise OSError(f"{path}: too short for a key (remove it: the next scan makes a new one)")
    return secret


def _mac(secret: bytes, document: dict[str, Any]) -> str:
    body = json.dumps(document, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
    return hmac.new(secret, body, hashlib.sha256).hexdigest()


def verdict_document(verdict: Verdict, options: ScanOptions, objects: str, secret: bytes) -> bytes:
    """A stored verdict: the outcome, what it was reached for (bundle, replay version, options, the stamp of the
    bundle's objects), and the MAC of all that under this user's key."""
    document = {
        "format": VERDICT_FORMAT,
        "bundle": verdict.digest,
        "replay": REPLAY_VERSION,
        "options": options.key(),
        "objects": objects,
        "verdict": verdict.outcome(),
    }
    return json.dumps(
        {**document, "mac": _mac(secret, document)}, sort_keys=True, separators=(",", ":"), allow_nan=False
    ).encode()


def parse_verdict(data: bytes, digest: str, options: ScanOptions, secret: bytes) -> tuple[dict, str] | None:
    """(outcome, stamp of the bundle's objects) of a stored verdict, or None when it is not one for (digest,
    version, options) or was not written by a scan holding `secret`."""
    try:
        doc = json.loads(data)
        mac = doc.pop("mac")
        outcome = doc["verdict"]
        if (
            doc.get("format") != VERDICT_FORMAT
            or doc.get("bundle") != digest
            or doc.get("replay") != REPLAY_VERSION
            or doc.get("options") != options.key()
            or outcome.get("status") not in CACHEABLE
            or not isinstance(mac, str)
            or not hmac.compare_digest(mac, _mac(secret, doc))
        ):
            return None
        return {k: outcome.get(k) for k in OUTCOME_FIELDS}, doc["objects"]
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def object_stamps(backend: Backend, states: Sequence[BundleState]) -> dict[str, str | None]:
    """Per bundle, the stamp of every object its markers reach (records, documents, chunks): a digest of their
    keys, sizes and modification times. An object rewritten, removed or truncated changes it; None when the walk
    already finds something missing or damaged. Costs the walk's reads of the small records and one look at
    each object's size and time, never its bytes."""
    from trajectory_replay.errors import NotFoundError
    from trajectory_replay.ops.walk import Walker

    trees = Walker(backend).trees(states)
    keys = sorted({k for tree in trees.values() for k in tree.keys})

    def stamp(key: str) -> tuple[int, float] | None:
        try:
            return backend.size(key), backend.mtime(key)
        except NotFoundError:
            return None

    stamps: dict[str, tuple[int, float] | None] = dict(zip(keys, backend._map(stamp, keys)))
    out: dict[str, str | None] = {}
    for name, tree in trees.items():
        mine = [[k, *found] for k in sorted(tree.keys) if (found := stamps[k]) is not None]
        sound = not (tree.problems or tree.missing or tree.corrupt) and len(mine) == len(tree.keys)
        out[name] = hash_bytes(json.dumps(mine, separators=(",", ":")).encode()) if sound else None
    return out


def one_line(text: Any) -> str:
    """`text` as one line (the non-blank lines joined by "; "), as a verdict's `detail` and every reason a scan
    gives are."""
    return "; ".join(part.strip() for part in str(text).splitlines() if part.strip())


__all__ = [
    "CACHEABLE",
    "DIVERGED",
    "ERROR",
    "INCOMPLETE",
    "INVALID",
    "KEY_FILE",
    "OUTCOME_FIELDS",
    "PASS",
    "REPLAY_VERSION",
    "SCAN_SEMANTICS",
    "ScanOptions",
    "UNSUPPORTED",
    "VERDICTS_DIR",
    "VERDICT_FORMAT",
    "VERDICT_STATUSES",
    "Verdict",
    "bundle_digest",
    "object_stamps",
    "one_line",
    "parse_verdict",
    "verdict_document",
    "verdict_key",
    "verdict_secret",
]
