"""BLAKE3 digests as written everywhere: `blake3:<64 lowercase hex>`, and the keys derived from them.

This module and `liveness` are the only code that builds the store's keys (the names at a root are
declared in `layout`): an object (chunk, blob record, JSON document) lives under
`objects/<2 hex>/<64 hex>`, the create-once ref from a blob to its record under
`blobs/<2 hex>/<64 hex>`. Everything above the store treats keys as opaque names it gets from here
(to report them, or to keep sets of them).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import blake3

from trajectory_replay.errors import InvalidKeyError
from trajectory_replay.store.layout import OBJECTS_DIR, REFS_DIR

if TYPE_CHECKING:
    from typing_extensions import Buffer

PREFIX = "blake3:"
_HEX = re.compile(r"[0-9a-f]{64}")
_DIGEST = re.compile(PREFIX + r"[0-9a-f]{64}")
_DIGEST_TEXT = re.compile(rb"blake3:[0-9a-f]{64}")
OBJECT, REF = "object", "ref"
"""The kinds of key `key_kind` tells apart."""
_PARALLEL_THRESHOLD = 8 << 20  # below this, threads cost more than they save


def hash_bytes(data: Buffer) -> str:
    """The digest of `data` (any bytes-like object)."""
    threads = blake3.blake3.AUTO if len(memoryview(data)) >= _PARALLEL_THRESHOLD else 1
    return PREFIX + blake3.blake3(data, max_threads=threads).hexdigest()


def raw_hash(data: Buffer) -> bytes:
    """The 32-byte BLAKE3 hash of `data` (block hashes are kept in this form)."""
    return blake3.blake3(data).digest()


def parse_digest(digest: str) -> str:
    """The 64-hex part of a digest; InvalidKeyError with the reason when malformed."""
    if type(digest) is str and _DIGEST.fullmatch(digest):  # the common case in one match (a large blob's record
        return digest[len(PREFIX) :]  # and a read of it check thousands of chunk digests)
    if not isinstance(digest, str):
        raise InvalidKeyError(f"invalid digest {digest!r}: expected a string 'blake3:<64 hex>'")
    if not digest.startswith(PREFIX):
        raise InvalidKeyError(f"invalid digest {digest!r}: must start with '{PREFIX}'")
    hexpart = digest[len(PREFIX) :]
    if len(hexpart) != 64:
        raise InvalidKeyError(f"invalid digest {digest!r}: expected 64 hex characters, got {len(hexpart)}")
    if not _HEX.fullmatch(hexpart):
        raise InvalidKeyError(f"invalid digest {digest!r}: not lowercase hexadecimal")
    return hexpart


def object_key(digest: str) -> str:
    """Key of the immutable object named by `digest`: objects/<2 hex>/<64 hex>."""
    h = parse_digest(digest)
    return f"{OBJECTS_DIR}/{h[:2]}/{h}"


def blob_ref_key(digest: str) -> str:
    """Key of the create-once ref from a blob digest to its record: blobs/<2 hex>/<64 hex>."""
    h = parse_digest(digest)
    return f"{REFS_DIR}/{h[:2]}/{h}"


def digest_from_key(key: str) -> str | None:
    """The digest an object or ref key names, or None for any other key (one the store does not name so)."""
    parts = key.split("/")
    if (
        len(parts) == 3
        and parts[0] in (OBJECTS_DIR, REFS_DIR)
        and _HEX.fullmatch(parts[2])
        and parts[1] == parts[2][:2]
    ):
        return PREFIX + parts[2]
    return None


def key_kind(key: str) -> str | None:
    """OBJECT or REF for a key in the store's object or ref directory (named as the store names them or not),
    None for any other key (markers, in-flight records)."""
    top, slash, _ = key.partition("/")
    if not slash:
        return None
    return OBJECT if top == OBJECTS_DIR else REF if top == REFS_DIR else None


def digests_in(data: bytes | bytearray) -> set[str]:
    """Every digest written out in `data`, found without parsing it."""
    return {match.decode() for match in _DIGEST_TEXT.findall(data)}
