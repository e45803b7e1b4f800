"""What may stand at the root of a store: every top-level name the package reserves, what it holds, and which of
the commands that walk a whole root (`ls`, `gc`, `fsck`) may touch what is under it.

    objects/     objects by digest: chunks, blob records, JSON documents      gc sweeps, fsck verifies and repairs
    blobs/       create-once refs from a blob's digest to its record          gc sweeps, fsck verifies and repairs
    .inflight/   writers' in-flight records (`store.liveness`)                gc removes expired ones
    .gc/         the sweep lease and epochs of gc (`store.liveness`)          gc
    .verdicts/   scan's verdicts, one per bundle content and replay options   scan only
    .probe/      a backend's create-once probe, removed as it ends            the backend only
    .recorder/   the flight recorder's triggers, one per step it fired at     capture, ls and scan read it
    <bundle>/    every other name: a bundle's directory, holding its markers  ls, gc and fsck

"Touch" means list as a bundle (`ls`), delete under (`gc`), verify or rewrite under (`fsck`); reading an
in-flight record to keep what it names is no touch. A bundle name is never a reserved name nor a dot-name
(`schema.check_name`), so a name of this table never designates a bundle, whatever it holds.
"""

from __future__ import annotations

from dataclasses import dataclass

from trajectory_replay.backends.probe import PROBE_DIR as _PROBE_NAME

LS, GC, FSCK = "ls", "gc", "fsck"
"""The commands that walk a whole root."""


@dataclass(frozen=True)
class RootEntry:
    """One reserved top-level name of a store root."""

    name: str
    holds: str
    touched_by: frozenset[str] = frozenset()
    """Which of `ls`, `gc` and `fsck` may touch the keys under it."""


OBJECTS = RootEntry("objects", "objects by digest: chunks, blob records, JSON documents", frozenset({GC, FSCK}))
REFS = RootEntry("blobs", "create-once refs from a blob's digest to its record", frozenset({GC, FSCK}))
INFLIGHT = RootEntry(".inflight", "writers' in-flight records", frozenset({GC}))
GC_STATE = RootEntry(".gc", "the sweep lease and epochs of gc", frozenset({GC}))
VERDICTS = RootEntry(".verdicts", "scan's verdicts")
PROBE = RootEntry(_PROBE_NAME, "a backend's create-once probe keys (`backends.probe`)")
RECORDER = RootEntry(".recorder", "the flight recorder's trigger markers, one per step a trigger fired at")

ROOT_ENTRIES = (OBJECTS, REFS, INFLIGHT, GC_STATE, VERDICTS, PROBE, RECORDER)
OBJECTS_DIR, REFS_DIR, INFLIGHT_DIR, GC_DIR, VERDICTS_DIR, PROBE_DIR, RECORDER_DIR = (e.name for e in ROOT_ENTRIES)
RESERVED_NAMES = frozenset(e.name for e in ROOT_ENTRIES)
"""No bundle is ever called so."""


def touched_by(command: str) -> tuple[str, ...]:
    """The reserved names under which `command` (LS, GC or FSCK) may touch keys, in table order."""
    return tuple(e.name for e in ROOT_ENTRIES if command in e.touched_by)


def is_bundle_dir(name: str) -> bool:
    """True when the top-level name `name` may be a bundle's directory: any name that is neither reserved nor a
    dot-name (bundle names never start with a dot)."""
    return name not in RESERVED_NAMES and not name.startswith(".")


__all__ = [
    "FSCK",
    "GC",
    "GC_DIR",
    "GC_STATE",
    "INFLIGHT",
    "INFLIGHT_DIR",
    "LS",
    "OBJECTS",
    "OBJECTS_DIR",
    "PROBE",
    "PROBE_DIR",
    "RECORDER",
    "RECORDER_DIR",
    "REFS",
    "REFS_DIR",
    "RESERVED_NAMES",
    "ROOT_ENTRIES",
    "RootEntry",
    "VERDICTS",
    "VERDICTS_DIR",
    "is_bundle_dir",
    "touched_by",
]
