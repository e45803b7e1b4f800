"""The BLAKE3 content-addressed object store over a backend: the names at a root (`layout`), blobs (`objectstore`)
and their records (`records`), the whole root in bulk (`inventory`), and the protocol that keeps objects alive
between writers and gc (`liveness`)."""

from trajectory_replay.store.cache import ReadCache, default_cache_dir
from trajectory_replay.store.chunking import ChunkingParams, chunk_ends
from trajectory_replay.store.digest import blob_ref_key, digest_from_key, hash_bytes, object_key, parse_digest
from trajectory_replay.store.inventory import Inventory
from trajectory_replay.store.objectstore import BlobRef, ObjectStore, PutPlan, PutStats
from trajectory_replay.store.records import BlobRecord, ChunkInfo

__all__ = [
    "BlobRecord",
    "BlobRef",
    "ChunkInfo",
    "ChunkingParams",
    "Inventory",
    "ObjectStore",
    "PutPlan",
    "PutStats",
    "ReadCache",
    "blob_ref_key",
    "chunk_ends",
    "default_cache_dir",
    "digest_from_key",
    "hash_bytes",
    "object_key",
    "parse_digest",
]
