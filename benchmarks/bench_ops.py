"""Store-operation benchmarks: `cp` to S3 against `s3fs put` of the same files, and `gc` / `fsck` over a
store of many small bundles against a bare read of every key."""

from __future__ import annotations

import multiprocessing
import os
import traceback
from pathlib import Path

from benchmarks.common import (
    Context,
    MiB,
    Row,
    fmt_bytes,
    fmt_rate,
    fmt_secs,
    median,
    settle,
    timed,
)
from benchmarks.data import big_case

GROUP = "ops"
TITLE = "ops: cp, gc and fsck over a whole store"
HOW = """\
**cp vs s3fs put**: a local store root (the real `BundleWriter`, fsync on) holding 10 step bundles
of 2,048 samples x 2,048 tokens, six float32 per-token payloads each (random, seeded per bundle, so
nothing deduplicates between bundles except the shared loss mask): about 1 GB of payload in about
1,000 chunk objects of ~1 MiB plus records, refs, documents and markers. It is copied with
`copy_bundles(root, "s3://<bucket>/cp-N", all_bundles=True)` into a fresh prefix (presence checks,
`read_many` at the source, BLAKE3 verification of every object, `If-None-Match` PUTs, then the
markers, and the destination's create-once probe), and the very same directory is uploaded with
`s3fs.S3FileSystem(...).put(root, "<bucket>/put-N", recursive=True)` (default settings) into another
fresh prefix: the same files, the same bytes, on the same server. The two alternate which goes first,
`sync` before each; the figure is best cp time / best put time (at most 1: cp is no slower than a
plain upload), every run in the detail column. Then cp runs again onto the first destination: it must
transfer nothing (0 objects, 0 bytes); its time is what checking presence of every key costs.
Prefixes are removed once measured.
**gc and fsck**: 10,000 small bundles (8 samples x 8 tokens, two float32 payloads of random content
plus the loss mask, and the three documents: four unique blobs, twelve objects and refs per bundle)
written by `BundleWriter` into one local root sharing one `ObjectStore`. To build them in seconds
rather than minutes, the writers' backend is a `LocalBackend` subclass that writes each file in place
(no temp file, fsync or rename) and skips the in-flight records, which a finished writer removes
anyway (their directory `.inflight/` is created empty, as the writer leaves it): the finished store
is byte for byte what the writer leaves; two forked processes share the work. Then the COMPLETE markers of one bundle
in ten are deleted (their objects become garbage).
**gc**: `collect_garbage(root, grace="0s")`, once (it is destructive), against the baseline run just
before it: a bare read of every key of the root, i.e. `backend.list("")` and `read_many` of all of
them (markers, refs, records, chunks) in batches of 256, the same batched thread-pool reads the
operations use. gc reads less than that (refs, records and manifests, not payload chunks), but also
stats and deletes the garbage and, before every delete batch, re-reads in-flight records and looks
for new markers: goal at most 2x. **fsck**: `check_store(root)` on the collected store, interleaved
with the same baseline; fsck reads and BLAKE3-hashes every object and also walks every bundle's tree
(refs, records and manifests a second time): goal at most 3x. Best times; page cache warm for all.
`--quick` runs 5 bundles of 256 samples (60 MiB) and 500 small bundles.
"""

CP_GOAL = 1.0
GC_GOAL = 2.0
FSCK_GOAL = 3.0
GARBAGE_EVERY = 10
"""One small bundle in GARBAGE_EVERY loses its COMPLETE marker before gc."""


# ---- cp vs s3fs put ---------------------------------------------------------------------------------------
def build_capture(root: Path, n_bundles: int, n_samples: int, tokens: int = 2048) -> int:
    """`n_bundles` step bundles of `n_samples` x `tokens` at `root` (random payloads); returns payload bytes."""
    import torch

    from trajectory_replay.bundle import BundleWriter
    from trajectory_replay.bundle.schema import ActorStepId, Identity

    case = big_case(n_samples, tokens, bundle_id="cap-00")  # documents; payload contents vary per bundle below
    total = 0
    for b in range(n_bundles):
        name = f"cap-{b:02d}"
        manifest = case.manifest.model_copy(update={"bundle_id": name})
        index = case.index.model_copy(
            update={"bundle_id": name, "identity": Identity(actor_step_id=ActorStepId(rollout_id=7, step_id=b))}
        )
        writer = BundleWriter(str(root / name), manifest, index, case.expected)
        g = torch.Generator().manual_seed(1000 + b)
        for payload in case.payloads:
            tensor = torch.randn(n_samples * tokens, generator=g)
            total += writer.write_payload(payload, tensor).size
        writer.finalize()
    return total


def tree_size(root: Path) -> tuple[int, int]:
    """(files, bytes) under `root`."""
    files = nbytes = 0
    for dirpath, _dirs, names in os.walk(root):
        for n in names:
            files += 1
            nbytes += os.path.getsize(os.path.join(dirpath, n))
    return files, nbytes


def cp_rows(ctx: Context) -> list[Row]:
    import s3fs

    from trajectory_replay.ops import copy_bundles

    n_bundles, n_samples = ctx.size(10, 5), ctx.size(2048, 256)
    root = ctx.path("capture")
    ctx.log(f"cp: writing {n_bundles} bundles of {n_samples}x2048 locally")
    payload_bytes = build_capture(root, n_bundles, n_samples)
    files, nbytes = tree_size(root)
    ctx.log(f"cp: {files} files, {fmt_bytes(nbytes)} ({fmt_bytes(payload_bytes)} of payload)")
    options = ctx.s3_options()
    bucket = ctx.s3_bucket()
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **options)
    # the server allocates a new bucket's volumes on its first writes: not part of either measurement
    fs.pipe({f"{bucket}/warmup/{i}": os.urandom(MiB) for i in range(16)})
    fs.rm(f"{bucket}/warmup", recursive=True)
    cps, puts, reports = [], [], []

    for rep in range(ctx.reps(2)):

        def run_cp(rep=rep):
            settle()
            t, report = timed(
                lambda: copy_bundles(str(root), f"s3://{bucket}/cp-{rep}", all_bundles=True, dest_options=options)
            )
            cps.append(t)
            reports.append(report)

        def run_put(rep=rep):
            settle()
            puts.append(timed(lambda: fs.put(str(root), f"{bucket}/put-{rep}", recursive=True))[0])

        first, second = (run_put, run_cp) if rep % 2 else (run_cp, run_put)
        first()
        second()
        uploaded = fs.find(f"{bucket}/put-{rep}", refresh=True)
        if len(uploaded) != files:
            raise RuntimeError(f"s3fs put uploaded {len(uploaded)} objects, expected {files}")
        ctx.log(
            f"cp run {rep}: cp {fmt_secs(cps[-1])} ({fmt_rate(nbytes, cps[-1])}), "
            f"s3fs put {fmt_secs(puts[-1])} ({fmt_rate(nbytes, puts[-1])})"
        )
        fs.rm(f"{bucket}/put-{rep}", recursive=True)
        if rep:
            fs.rm(f"{bucket}/cp-{rep}", recursive=True)

    settle()
    t_again, again = timed(
        lambda: copy_bundles(str(root), f"s3://{bucket}/cp-0", all_bundles=True, dest_options=options)
    )
    ctx.log(f"cp again: {fmt_secs(t_again)}, {again.objects_copied} objects copied")
    fs.rm(bucket, recursive=True)

    first = reports[0]
    ratio = min(cps) / min(puts)
    paired = median([c / p for c, p in zip(cps, puts)])
    detail = (
        f"best cp {fmt_secs(min(cps))} ({fmt_rate(nbytes, min(cps))}), best s3fs put {fmt_secs(min(puts))} "
        f"({fmt_rate(nbytes, min(puts))}); runs cp/put: "
        + ", ".join(f"{fmt_secs(c)}/{fmt_secs(p)}" for c, p in zip(cps, puts))
        + (f"; median of the per-run ratios {paired:.2f}x" if len(cps) > 1 else "")
        + f"; {files} files ({fmt_bytes(nbytes)}); cp wrote {first.objects_copied} objects "
        f"({fmt_bytes(first.bytes_copied)}) + {first.markers_written} markers"
    )
    rows = [
        Row(
            GROUP,
            f"cp --all local -> S3, {n_bundles} bundles ({fmt_bytes(payload_bytes)} payload) "
            f"vs s3fs put of the same files",
            f"{ratio:.2f}x",
            f"<= {CP_GOAL:.1f}x (cp time / put time)",
            ratio <= CP_GOAL,
            detail,
        )
    ]
    ok = again.objects_copied == 0 and again.bytes_copied == 0 and again.markers_written == 0
    rows.append(
        Row(
            GROUP,
            "cp again onto the same destination",
            f"{again.objects_copied} objects, {fmt_secs(t_again)}",
            "0 objects transferred",
            ok,
            f"{again.objects_skipped} objects and refs found present, {again.markers_skipped} markers "
            f"skipped, {again.bytes_copied} B copied; {t_again / min(cps):.0%} of the best first cp",
        )
    )
    return rows


# ---- gc and fsck ------------------------------------------------------------------------------------------
def _bulk_backend_class():
    from trajectory_replay.backends import ProbeResult
    from trajectory_replay.backends.local import LocalBackend

    class BulkLocal(LocalBackend):
        """Writes files in place (no temp file, fsync or rename); skips in-flight records. For building only."""

        max_workers = 1

        def _write(self, key, data, *args, **kwargs) -> None:
            if key.startswith(".inflight/"):
                return
            path = self._path(key)
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "wb") as f:
                f.write(data)

        def _create(self, key, data, *args, **kwargs) -> bool:
            path = self._path(key)
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
            try:
                fd = os.open(path, flags, 0o644)
            except FileNotFoundError:
                path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(path, flags, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            return True

        def _delete(self, key, *args, **kwargs) -> None:
            if not key.startswith(".inflight/"):
                super()._delete(key, *args, **kwargs)

        def probe(self) -> ProbeResult:
            return ProbeResult(True, {"bulk build": True})

    return BulkLocal


def _write_small(root: str, indices, case) -> None:
    import torch

    from trajectory_replay.bundle import BundleWriter
    from trajectory_replay.bundle.schema import ActorStepId, Identity
    from trajectory_replay.store import ObjectStore

    store = ObjectStore(_bulk_backend_class()(root))
    tokens = case.payloads["old_log_probs"].numel()
    for i in indices:
        name = f"b{i:05d}"
        manifest = case.manifest.model_copy(update={"bundle_id": name})
        index = case.index.model_copy(
            update={
                "bundle_id": name,
                "identity": Identity(actor_step_id=ActorStepId(rollout_id=i // 100, step_id=i % 100)),
            }
        )
        writer = BundleWriter(f"{root}/{name}", manifest, index, case.expected, store=store)
        g = torch.Generator().manual_seed(i)
        writer.write_payload("old_log_probs", -torch.rand(tokens, generator=g))
        writer.write_payload("log_probs", -torch.rand(tokens, generator=g))
        writer.finalize()


def _write_part(root: str, indices: list[int]) -> None:
    try:
        import torch

        torch.set_num_threads(1)  # a forked child must not enter the parent's OpenMP pool
        _write_small(root, indices, big_case(8, 8, bundle_id="small"))
    except BaseException:  # noqa: BLE001 - a forked worker reports and exits, never returns to the parent's code
        traceback.print_exc()
        os._exit(1)


def build_small(root: Path, n: int, workers: int = 2) -> None:
    """`n` small bundles at `root`; bundle 0 first (it writes the blobs all share), the rest by forked workers."""
    _write_small(str(root), [0], big_case(8, 8, bundle_id="small"))
    (root / ".inflight").mkdir(exist_ok=True)  # the writers' in-flight directory, left empty when they finish
    rest = list(range(1, n))
    try:
        mp = multiprocessing.get_context("fork")
    except ValueError:
        mp = None
    if mp is None or workers <= 1:
        _write_part(str(root), rest)
        return
    procs = [mp.Process(target=_write_part, args=(str(root), rest[k::workers])) for k in range(workers)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode != 0 for p in procs):
        raise RuntimeError(f"building the small bundles failed (exit codes {[p.exitcode for p in procs]})")


def bare_read(root: Path) -> tuple[int, int]:
    """The baseline: list every key of the root and read them all in batches of 256; (keys, bytes)."""
    from trajectory_replay.backends.local import LocalBackend
    from trajectory_replay.store.inventory import READ_BATCH, batched

    backend = LocalBackend(root)
    keys = backend.list("")
    nbytes = 0
    for batch in batched(keys, READ_BATCH):
        nbytes += sum(map(len, backend.read_many(batch)))
    return len(keys), nbytes


def stored_keys(root: Path) -> int:
    """How many objects and blob refs the root holds."""
    from trajectory_replay.backends.local import LocalBackend

    backend = LocalBackend(root)
    return len(backend.list("objects/")) + len(backend.list("blobs/"))


def gc_fsck_rows(ctx: Context) -> list[Row]:
    from trajectory_replay.ops import check_store, collect_garbage

    n = ctx.size(10_000, 500)
    root = ctx.path("small")
    ctx.log(f"gc/fsck: writing {n} small bundles")
    t_build = timed(lambda: build_small(root, n))[0]
    garbage = [i for i in range(n) if i % GARBAGE_EVERY == GARBAGE_EVERY // 2]
    for i in garbage:
        os.unlink(root / f"b{i:05d}" / "COMPLETE")
    settle()
    t_base_gc, (keys_before, bytes_before) = timed(lambda: bare_read(root))
    ctx.log(f"gc/fsck: built in {fmt_secs(t_build)}; bare read of {keys_before} keys {fmt_secs(t_base_gc)}")
    stored_before = stored_keys(root)
    settle()
    t_gc, gc_report = timed(lambda: collect_garbage(str(root), grace="0s"))
    stored_after = stored_keys(root)
    ctx.log(f"gc: {fmt_secs(t_gc)}, removed {gc_report.objects_removed} objects + {gc_report.refs_removed} refs")

    fscks, bases, fsck_report, keys_after = [], [], None, 0
    for rep in range(ctx.reps(2)):

        def run_base():
            nonlocal keys_after
            settle()
            t, (keys_after, _b) = timed(lambda: bare_read(root))
            bases.append(t)

        def run_fsck():
            nonlocal fsck_report
            settle()
            t, fsck_report = timed(lambda: check_store(str(root)))
            fscks.append(t)

        first, second = (run_fsck, run_base) if rep % 2 else (run_base, run_fsck)
        first()
        second()
        ctx.log(f"fsck run {rep}: {fmt_secs(fscks[-1])}, bare read {fmt_secs(bases[-1])}")

    live = n - len(garbage)
    removed = gc_report.objects_removed + gc_report.refs_removed
    gc_ratio = t_gc / t_base_gc
    gc_ok = stored_before - stored_after == removed and removed > 0 and not gc_report.conflicts
    rows = [
        Row(
            GROUP,
            f"gc --grace 0s, {n:,} small bundles ({len(garbage):,} without COMPLETE) vs a bare read of every key",
            f"{gc_ratio:.2f}x ({t_gc / n * 1000:.2f} ms/bundle)",
            f"- (no goal set; project target <= {GC_GOAL:.0f}x)",
            None if gc_ok else False,
            f"gc {fmt_secs(t_gc)}: removed {gc_report.objects_removed} objects + {gc_report.refs_removed} refs "
            f"({removed / max(len(garbage), 1):.0f} per abandoned bundle, {fmt_bytes(gc_report.bytes_freed)}), "
            f"kept {gc_report.objects_live} live keys; bare read of {keys_before:,} keys "
            f"({fmt_bytes(bytes_before)}) {fmt_secs(t_base_gc)}; built in {fmt_secs(t_build)}",
        )
    ]
    fsck_ratio = min(fscks) / min(bases)
    r = fsck_report
    fsck_ok = r.healthy and not r.orphaned and r.bundles == live
    rows.append(
        Row(
            GROUP,
            f"fsck, {live:,} small bundles vs a bare read of every key",
            f"{fsck_ratio:.2f}x ({min(fscks) / live * 1000:.2f} ms/bundle)",
            f"- (no goal set; project target <= {FSCK_GOAL:.0f}x)",
            None if fsck_ok else False,
            f"best fsck {fmt_secs(min(fscks))}, best bare read of {keys_after:,} keys {fmt_secs(min(bases))}; "
            "runs fsck/read: "
            + ", ".join(f"{fmt_secs(a)}/{fmt_secs(b)}" for a, b in zip(fscks, bases))
            + f"; {r.objects_checked:,} objects + {r.refs_checked:,} refs verified, {r.bundles:,} bundles, "
            f"{'healthy' if r.healthy else 'NOT healthy'}, {len(r.orphaned)} orphans",
        )
    )
    return rows


def _guarded(ctx: Context, name: str, fn) -> list[Row]:
    """One part's rows; an error row when it raises, so the other part still runs."""
    try:
        return fn(ctx)
    except Exception as exc:  # noqa: BLE001 - reported as a row
        traceback.print_exc()
        return [Row(GROUP, name, "error", "-", None, f"{type(exc).__name__}: {exc}")]


def run(ctx: Context) -> list[Row]:
    # gc/fsck first: it forks its builders, best done before the S3 client's threads exist
    small = _guarded(ctx, "gc / fsck", gc_fsck_rows)
    return _guarded(ctx, "cp vs s3fs put", cp_rows) + small
