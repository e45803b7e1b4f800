"""Building stores for the store-operation tests: canonical bundles, multi-rank cohorts, a bigger store."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from trajectory_replay.backends import open_backend
from trajectory_replay.bundle import BundleWriter, open_sources
from trajectory_replay.bundle.status import bundle_status
from trajectory_replay.ops.walk import Walker
from trajectory_replay.replay import canonical_case
from trajectory_replay.replay.validate import validate_sources
from trajectory_replay.store import ObjectStore
from trajectory_replay.store.chunking import ChunkingParams


def renamed_case(name: str, buggy: bool = False):
    case = canonical_case(buggy=buggy)
    return case._replace(
        manifest=case.manifest.model_copy(update={"bundle_id": name}),
        index=case.index.model_copy(update={"bundle_id": name}),
    )


def rank_writer(root: str, name: str, rank: int, expected_ranks: Sequence[int], **kwargs) -> BundleWriter:
    case = renamed_case(name)
    return BundleWriter(
        f"{root}/{name}",
        case.manifest,
        case.index,
        case.expected,
        rank=rank,
        expected_ranks=list(expected_ranks),
        **kwargs,
    )


def write_ranks(root: str, name: str, land: Sequence[int], expected_ranks: Sequence[int], **kwargs) -> None:
    """Land ranks `land` of a multi-rank bundle (each rank holds the canonical case)."""
    case = renamed_case(name)
    for rank in land:
        writer = rank_writer(root, name, rank, expected_ranks, **kwargs)
        for payload, tensor in case.payloads.items():
            writer.write_payload(payload, tensor)
        writer.finalize()


def write_big(
    root: str, name: str, seed: int, *, chunks: int = 600, chunk_size: int = 8 << 10, store: ObjectStore | None = None
) -> str:
    """A canonical bundle plus an `extra` 2-D payload cut into `chunks` small chunks (many objects)."""
    store = store or ObjectStore(
        open_backend(root), chunking=ChunkingParams(chunk_size=chunk_size, min_size=chunk_size, target_size=chunk_size)
    )
    case = renamed_case(name)
    writer = BundleWriter(f"{root}/{name}", case.manifest, case.index, case.expected, store=store)
    for payload, tensor in case.payloads.items():
        writer.write_payload(payload, tensor)
    gen = torch.Generator().manual_seed(seed)
    writer.write_payload("extra", torch.rand((chunks, chunk_size // 4), generator=gen))
    writer.finalize()
    return f"{root}/{name}"


def reachable(root: str, name: str, **options) -> set[str]:
    """Every key bundle `name` needs: its markers and its tree."""
    backend = open_backend(root, **options)
    state = bundle_status(backend, name)
    assert state is not None, name
    tree = Walker(backend).trees([state])[name]
    assert tree.resolved, tree.problems
    return tree.keys | set(state.marker_keys)


def validates(path: str, **options) -> bool:
    report = validate_sources(path, open_sources(path, **options))
    assert report.valid, report.problems
    return True
