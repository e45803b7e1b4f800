"""One process of the gc stress test: `python -m tests.ops.gc_stress ROLE ROOT START SECONDS OPTIONS_JSON [ID]`.

START is a wall-clock time, or `stdin`: the process then prints `ready` once it has imported everything and
opened the store, and reads START from stdin, so that the caller starts every process's clock together only
when all are ready, however long a loaded machine takes to start them.

Time is cut into rounds of ROUND seconds from START. In round k the `aborter` writes the payloads of
content k and gives up (they become garbage); the `writer`s write whole bundles of the same content k
a moment later, reusing what gc is sweeping meanwhile, and write a bundle again when its commit is
refused (as capture would); `gc` sweeps with grace 0 in a loop, and once more when the time is up. Each
process prints one JSON line of counts when its time is up. On a loaded machine a round can take several
times ROUND; the aborter and the writers then go on past the time, up to OVERTIME seconds, until they have
done the least the test checks (MINIMUM). The GC_STRESS_* variables change the shape (round length, payload
rows, the writers' delay range).
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
import uuid
from typing import TYPE_CHECKING

from trajectory_replay.bundle import BundleWriter
from trajectory_replay.errors import TrajectoryReplayError
from trajectory_replay.ops.gc import collect_garbage
from trajectory_replay.store import ObjectStore
from trajectory_replay.store.chunking import ChunkingParams

if TYPE_CHECKING:  # the gc role never builds a tensor: it runs without torch, as the gc command does
    import torch

ROUND = float(os.environ.get("GC_STRESS_ROUND", "0.6"))
SIZE = int(os.environ.get("GC_STRESS_ROWS", "64"))
SPREAD = (float(os.environ.get("GC_STRESS_FROM", "0.02")), float(os.environ.get("GC_STRESS_TO", "0.4")))
CHUNKING = ChunkingParams(chunk_size=16 << 10, min_size=16 << 10, target_size=16 << 10)
MINIMUM = {"aborter": ("aborted", 3), "writer": ("completed", 1)}
OVERTIME = 60.0


def content(k: int) -> dict[str, torch.Tensor]:
    """The payloads of content k: the canonical ones plus one of its own, cut into many chunks."""
    import torch

    from trajectory_replay.replay import canonical_case

    gen = torch.Generator().manual_seed(k)
    return {**canonical_case(False).payloads, "extra": torch.rand((SIZE, 4096), generator=gen)}


def writer_for(root: str, name: str, store: ObjectStore) -> BundleWriter:
    from trajectory_replay.replay import canonical_case

    case = canonical_case(False)
    manifest = case.manifest.model_copy(update={"bundle_id": name})
    index = case.index.model_copy(update={"bundle_id": name})
    return BundleWriter(f"{root}/{name}", manifest, index, case.expected, store=store)


def main(role: str, root: str, start: float | str, seconds: float, options: dict, ident: str = "0") -> None:
    store = ObjectStore.open(root, cache=False, **options)
    store.chunking = CHUNKING
    if role != "gc":
        content(0)  # the first round is not slowed by what runs once (torch's first operations)
    if start == "stdin":
        print("ready", flush=True)
        start = float(sys.stdin.readline())
    rng = random.Random(f"{role}-{ident}")
    counts = {"role": role, "id": ident, "completed": 0, "refused": 0, "aborted": 0, "removed": 0, "sweeps": 0}
    deadline = start + seconds

    def sweep() -> None:
        report = collect_garbage(root, grace=0.0, **options)
        counts["sweeps"] += 1
        counts["removed"] += len(report.removed)

    def more() -> bool:
        now = time.time()
        if now < deadline:
            return True
        field, least = MINIMUM.get(role, ("", 0))
        return bool(field) and counts[field] < least and now < deadline + OVERTIME

    while more():
        k = int((time.time() - start) // ROUND)
        round_start = start + k * ROUND
        if role == "gc":
            sweep()
            continue
        if role == "aborter":
            writer = writer_for(root, f"aborted-{uuid.uuid4().hex[:8]}", store)
            # plus garbage of its own that no writer reuses, so every sweep has something to remove
            import torch

            writer.write_payloads(
                {
                    **content(k),
                    "noise": torch.rand(2048, generator=torch.Generator().manual_seed(rng.randrange(1 << 62))),
                }
            )
            writer.abort()
            counts["aborted"] += 1
        else:
            time.sleep(max(0.0, round_start + rng.uniform(*SPREAD) - time.time()))
            payloads = content(k)
            for _attempt in range(3):  # a refused commit is written again, as capture would
                writer = writer_for(root, f"w{ident}-{k}-{uuid.uuid4().hex[:8]}", store)
                try:
                    if rng.random() < 0.5:  # everything in one batch: lost objects can be stored again
                        writer.finalize(payloads=payloads)
                    else:  # payloads first: a lost one refuses the commit
                        writer.write_payloads(payloads)
                        writer.finalize()
                    counts["completed"] += 1
                    break
                except TrajectoryReplayError as exc:
                    if "concurrent gc" not in str(exc):
                        raise
                    writer.abort()
                    counts["refused"] += 1
        time.sleep(max(0.0, start + (k + 1) * ROUND - time.time()))
    if role == "gc":
        # one sweep more, begun after every round has: on a loaded machine a sweep can take the whole run, and
        # have begun before the first abort; this one always has garbage to find, while the others' last
        # commits may still be under way
        sweep()
    print(json.dumps(counts), flush=True)


if __name__ == "__main__":
    main(
        sys.argv[1],
        sys.argv[2],
        sys.argv[3] if sys.argv[3] == "stdin" else float(sys.argv[3]),
        float(sys.argv[4]),
        json.loads(sys.argv[5]),
        *sys.argv[6:],
    )
