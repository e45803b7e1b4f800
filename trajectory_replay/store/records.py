"""The blob record: what a blob is made of (its size, its chunks' digests and sizes, the block size and the hash of
every block), its format as stored, and how a stored record is read back: bounded in size and nesting, checked
against its digest, then parsed and checked in structure. Also the bound on a blob ref, which holds one record's
digest.
"""

from __future__ import annotations

import base64
import binascii
import functools
import json
import sys
from dataclasses import dataclass
from typing import Any, NamedTuple

from trajectory_replay.errors import IntegrityError, ValueTooLargeError
from trajectory_replay.store.digest import hash_bytes, parse_digest
from trajectory_replay.store.jsonbound import MAX_JSON_DEPTH, nesting_exceeds

RECORD_FORMAT = "trajectory-replay.blob/1"
MAX_RECORD_BYTES = 64 << 20
"""Records are parsed only after their digest is checked, and never when larger than this."""
MAX_REF_BYTES = 1 << 10
"""A blob ref holds one digest (and perhaps a newline): anything much longer is not read."""
RECORD_HEAD = b'{"format":"' + RECORD_FORMAT.encode() + b'"'
"""The first bytes of every record: `BlobRecord.to_bytes` writes the format first, so that an object can
be recognized as a record from a short ranged read."""


class RecordError(IntegrityError):
    """An object that is not the blob record it was expected to be; `reason` says why in a few words."""

    def __init__(self, message: str, reason: str | None = None) -> None:
        # the reason defaults to the message: a caller that prefixes a location re-raises with the message alone
        super().__init__(message)
        self.reason = reason or message


class ChunkInfo(NamedTuple):
    """One chunk of a blob: digest, size, offset in the blob, and its block hashes (32 bytes each). A named tuple:
    a record of a large payload holds thousands, made each time the record is read."""

    digest: str
    size: int
    offset: int
    blocks: bytes


@dataclass(frozen=True)
class BlobRecord:
    """The parsed record of a blob."""

    digest: str
    size: int
    block_size: int
    chunks: tuple[ChunkInfo, ...]

    @functools.cached_property
    def chunk_offsets(self) -> list[int]:
        """Each chunk's offset in the blob (increasing)."""
        return [c.offset for c in self.chunks]

    def to_bytes(self) -> bytes:
        # the format goes first: RECORD_HEAD depends on it
        doc = {
            "format": RECORD_FORMAT,
            "digest": self.digest,
            "size": self.size,
            "block_size": self.block_size,
            "chunks": [[c.digest, c.size, base64.b64encode(c.blocks).decode()] for c in self.chunks],
        }
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes | bytearray, where: str) -> BlobRecord:
        """Parse and structurally check a record whose digest has already been verified."""
        doc = _record_document(data, where)
        try:
            size, block_size = int(doc["size"]), int(doc["block_size"])
            if block_size <= 0 or size < 0:
                raise ValueError("non-positive block size or negative size")
            parse_digest(doc["digest"])
            chunks, offset = [], 0
            for digest, csize, blocks_b64 in doc["chunks"]:
                parse_digest(digest)
                blocks = _decode_blocks(blocks_b64)
                if csize <= 0 or len(blocks) != 32 * -(-csize // block_size):
                    raise ValueError(f"chunk {digest} has {len(blocks) // 32} block hashes for {csize} bytes")
                csize = int(csize)
                chunks.append(ChunkInfo(digest, csize, offset, blocks))
                offset += csize
            if offset != size:
                raise ValueError(f"chunk sizes add up to {offset}, record says {size}")
        except (ValueError, KeyError, TypeError) as exc:
            message = f"malformed blob record {where}: {exc}"
            raise RecordError(message, message) from None
        return cls(doc["digest"], size, block_size, tuple(chunks))


def _record_document(data: bytes | bytearray, where: str) -> dict:
    """The JSON object of a record; RecordError when the object is not a record at all (a chunk, a document or
    other JSON stored under the digest a reference calls a record)."""
    try:
        doc = json.loads(data)
    except ValueError:  # UnicodeDecodeError included: a binary chunk
        doc = None
    except RecursionError:
        message = f"malformed blob record {where}: nested too deeply"
        raise RecordError(message, message) from None
    if not isinstance(doc, dict) or doc.get("format") != RECORD_FORMAT:
        found = (
            f"format {doc.get('format')!r}"
            if isinstance(doc, dict)
            else "not JSON"
            if doc is None
            else f"a JSON {type(doc).__name__}"
        )
        raise RecordError(
            f"malformed blob record {where}: the object is not a blob record ({found})", "not a blob record"
        )
    return doc


def _decode_blocks(text: Any) -> bytes:
    """A chunk's block hashes from their base64 text; ValueError (binascii.Error) for anything but clean base64."""
    if sys.version_info >= (3, 11) and type(text) is str:  # one call instead of a pattern match, then a decode
        return binascii.a2b_base64(text, strict_mode=True)
    return base64.b64decode(text, validate=True)


def looks_like_record(head: bytes) -> bool:
    """True when an object's first bytes (at least len(RECORD_HEAD) of them) are those of a blob record."""
    return head.startswith(RECORD_HEAD)


def decode_record(data: bytes | bytearray, where: str) -> BlobRecord:
    """Parse a record whose digest is verified: bounded in size and nesting before the JSON parser sees it
    (correctly addressed bytes can still be hostile). RecordError saying why it is not a record."""
    if len(data) > MAX_RECORD_BYTES:
        reason = f"{len(data)} bytes, over the {MAX_RECORD_BYTES}-byte bound"
        raise RecordError(f"malformed blob record {where}: {reason}", reason)
    if nesting_exceeds(data):
        reason = f"nested more than {MAX_JSON_DEPTH} levels deep"
        raise RecordError(f"malformed blob record {where}: {reason}", reason)
    return BlobRecord.from_bytes(data, where)


def oversized_record(where: str, exc: ValueTooLargeError) -> RecordError:
    """The RecordError of a record object the store refused, unread, for being over MAX_RECORD_BYTES."""
    return RecordError(f"malformed blob record {where}: {exc}", f"over the {MAX_RECORD_BYTES}-byte bound")


def parse_record(digest: str, data: bytes | bytearray) -> BlobRecord | RecordError:
    """The record object `digest` holds, its content checked against the digest first; the RecordError
    (returned, not raised) when the bytes are not that record."""
    actual = hash_bytes(data)
    if actual != digest:
        return RecordError(
            f"record {digest} does not match its digest (hashes to {actual})", f"content hashes to {actual}"
        )
    try:
        return decode_record(data, digest)
    except RecordError as exc:
        return exc


__all__ = [
    "MAX_RECORD_BYTES",
    "MAX_REF_BYTES",
    "RECORD_FORMAT",
    "RECORD_HEAD",
    "BlobRecord",
    "ChunkInfo",
    "RecordError",
    "decode_record",
    "looks_like_record",
    "oversized_record",
    "parse_record",
]
