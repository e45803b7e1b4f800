"""Object-store benchmarks: put/get throughput against plain fsspec, dedup of a repeated put and of
overlapping row ranges, and the bytes a ranged read fetches from a cold cache.

Every ratio is measured side by side in one run, on the same backend, with bytes counted at the
backend layer (`Backend.stats`), which sees every byte fetched or written, records and refs included.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field

from benchmarks.common import (
    Context,
    KiB,
    MiB,
    Row,
    fmt_bytes,
    fmt_rate,
    fmt_secs,
    median,
    settle,
    timed,
)

GROUP = "store"
TITLE = "store: content-addressed object store"
HOW = """\
One process, one run, each figure a ratio of two measurements taken side by side. **put/get**: a
512 MiB buffer of float32 tensor bytes (`torch.randn`, seeded) is stored with `ObjectStore.put` into a
fresh store (a new directory or S3 prefix for every repetition) and, interleaved with it (alternating
which goes first), written as one object with fsspec `pipe_file` on the same backend (local: a
`LocalFileSystem` path in the same scratch directory on the same disk; S3: `s3fs` against the same
server, default settings, i.e. a concurrent multipart upload). Then the blob is read back with
`ObjectStore.get` (S3: through a new, empty read cache each time, the default for remote stores) and the
object with `cat_file`. Dirty pages are flushed (`sync`) before every timed step. Local runs 5
repetitions, S3 3, each pair back to back with the order alternating; the figure is the median over the
repetitions of fsspec time / store time (above 1: the store is faster), which one run disturbed by other work
on a shared machine cannot sway (`pipe_file` only fills the page cache, and now and then a run of it escapes
writeback entirely). The detail column lists every run and the best of each side.
The store does more work than the baseline on purpose: it hashes everything (BLAKE3 of the blob, of
every 4 MiB chunk and of every 16 KiB block), fsyncs each chunk on local disk before linking it into
place, and verifies every chunk and the whole blob on `get`. As floors, the detail column also gives
the time `ObjectStore.plan` (all the hashing, no writes) takes on its own, and the time of the bare
backend reads of the blob's chunk objects (`read_many`, no verification, no assembly).
**put again**: after each repetition's get, the same 512 MiB is put a second time into the same store;
bytes written are the backend's `bytes_written` during that put (the most over the repetitions), and the
speedup is best first put / best second put.
**overlapping rows**: 4,096 rows of 64 KiB of distinct random content (256 MiB) put with the row starts
as `cuts`, then rows 1000..3047 (128 MiB) as a new blob with its own row starts; new bytes are
everything the backend wrote during the second put (chunks, record and ref) over the second blob's size.
**ranged read**: 1 MiB starting 5,000 bytes past the middle of a 512 MiB blob on S3, read with
`read_range` given the blob's `BlobRef` (as a manifest holds it) from a store opened with a new, empty
cache directory; fetched is the backend's `bytes_read` (the record plus the covering blocks), compared
with 1 MiB + two 16 KiB blocks + the record's size.
`--quick` runs the same steps on 32 MiB blobs (512 rows), once each.
"""

PUT_GET_GOAL = 0.8
DEDUP_SPEEDUP_GOAL = 5.0
OVERLAP_GOAL = 0.10


def tensor_bytes(nbytes: int, seed: int) -> bytes:
    """`nbytes` of float32 normal samples (torch tensor memory), as one bytes object."""
    import torch

    buf = bytearray(nbytes)
    tensor = torch.frombuffer(buf, dtype=torch.float32)
    tensor.normal_(generator=torch.Generator().manual_seed(seed))
    del tensor
    return bytes(buf)


@dataclass
class Side:
    """Timings of one backend's put/get comparison."""

    backend: str
    store_put: list[float] = field(default_factory=list)
    plain_put: list[float] = field(default_factory=list)
    store_get: list[float] = field(default_factory=list)
    plain_get: list[float] = field(default_factory=list)
    reput: list[float] = field(default_factory=list)
    reput_written: list[int] = field(default_factory=list)
    reput_read: list[int] = field(default_factory=list)
    plan: float = 0.0
    reads_alone: float = 0.0
    refs: list = field(default_factory=list)


class LocalTarget:
    name = "local"
    repeats = 5

    def __init__(self, ctx: Context) -> None:
        import fsspec

        self.ctx = ctx
        self.fs = fsspec.filesystem("file")

    def plain_path(self, i: int) -> str:
        return str(self.ctx.path(f"plain-{i}") / "blob")

    def store(self, i: int):
        from trajectory_replay.store import ObjectStore

        return ObjectStore.open(str(self.ctx.path(f"store-{i}")))

    def reader(self, i: int, writer):
        return writer  # local stores are read directly (no cache)

    def done_reading(self, store) -> None:
        pass


class S3Target:
    name = "S3"
    repeats = 3

    def __init__(self, ctx: Context) -> None:
        import s3fs

        self.ctx = ctx
        self.options = ctx.s3_options()
        self.bucket = ctx.s3_bucket()
        self.fs = s3fs.S3FileSystem(skip_instance_cache=True, **self.options)

    def plain_path(self, i: int) -> str:
        return f"{self.bucket}/plain-{i}/blob"

    def url(self, i: int) -> str:
        return f"s3://{self.bucket}/store-{i}"

    def store(self, i: int):
        from trajectory_replay.store import ObjectStore

        return ObjectStore.open(self.url(i), cache_dir=str(self.ctx.path("cache")), **self.options)

    def reader(self, i: int, writer):
        return self.store(i)  # a new store with a new, empty cache: the get crosses the network

    def done_reading(self, store) -> None:
        if store.cache is not None:
            shutil.rmtree(store.cache.directory, ignore_errors=True)


def one_repetition(ctx: Context, target, side: Side, i: int, data: bytes):
    """Repetition `i`: put into a fresh store and pipe_file, get and cat_file (alternating which of
    each pair goes first), then the same put again. Returns the store it wrote."""
    size = len(data)
    plain_path = target.plain_path(i)
    store = target.store(i)

    def plain_put():
        settle()
        side.plain_put.append(timed(lambda: target.fs.pipe_file(plain_path, data))[0])

    def store_put():
        settle()
        t, ref = timed(lambda: store.put(data))
        side.store_put.append(t)
        side.refs.append(ref)

    def plain_get():
        settle()
        t, out = timed(lambda: target.fs.cat_file(plain_path))
        side.plain_get.append(t)
        assert len(out) == size and out == data, "fsspec read back different bytes"

    def store_get():
        reader = target.reader(i, store)
        settle()
        t, out = timed(lambda: reader.get(side.refs[-1]))
        side.store_get.append(t)
        assert out == data, "the store returned different bytes"
        del out
        target.done_reading(reader)

    for first, second in ((plain_put, store_put), (plain_get, store_get)):
        if i % 2:
            first, second = second, first
        first()
        second()
    ctx.log(
        f"{target.name} run {i}: put fsspec {fmt_rate(size, side.plain_put[-1])}, "
        f"store {fmt_rate(size, side.store_put[-1])}; get fsspec {fmt_rate(size, side.plain_get[-1])}, "
        f"store {fmt_rate(size, side.store_get[-1])}"
    )

    settle()
    stats = store.backend.stats
    before_w, before_r = stats.bytes_written, stats.bytes_read
    t, again = timed(lambda: store.put(data))
    assert again == side.refs[-1]
    side.reput.append(t)
    side.reput_written.append(stats.bytes_written - before_w)
    side.reput_read.append(stats.bytes_read - before_r)
    ctx.log(f"{target.name} run {i}: put again {fmt_secs(t)}, wrote {side.reput_written[-1]} B")
    return store


def measure_put_get(ctx: Context, target, data: bytes) -> Side:
    from trajectory_replay.store.digest import object_key

    side = Side(target.name)
    repeats = ctx.reps(target.repeats)
    stores = [one_repetition(ctx, target, side, i, data) for i in range(repeats)]

    # diagnostics, once each: hashing alone (no writes) on a fresh store, the bare backend reads of the
    # blob's chunk objects (no verification, no assembly): the floors under put and get
    fresh = target.store(repeats)
    settle()
    side.plan = timed(lambda: fresh.plan(data))[0]
    reader = target.reader(0, stores[0])
    keys = [object_key(c.digest) for c in reader.record(side.refs[0]).chunks]
    settle()
    side.reads_alone = timed(lambda: reader.backend.read_many(keys))[0]
    target.done_reading(reader)
    return side


def put_get_rows(side: Side, size: int) -> list[Row]:
    rows = []
    label = fmt_bytes(size)
    for op, store_t, plain_t, what in (
        ("put", side.store_put, side.plain_put, "pipe_file"),
        ("get", side.store_get, side.plain_get, "cat_file"),
    ):
        s, p = min(store_t), min(plain_t)
        # each repetition's pair ran back to back: the median of their ratios is not swayed by one run that the
        # machine disturbed (or, for the page-cache-only pipe_file, one that happened to skip writeback)
        ratio = median([b / a for a, b in zip(store_t, plain_t)])
        detail = (
            f"median of {len(store_t)} per-run ratios; runs store/fsspec: "
            + ", ".join(f"{fmt_secs(a)}/{fmt_secs(b)}" for a, b in zip(store_t, plain_t))
            + f"; best store {fmt_rate(size, s)} ({fmt_secs(s)}), best fsspec {what} {fmt_rate(size, p)} "
            f"({fmt_secs(p)}), best vs best {p / s:.2f}x"
        )
        if op == "put":
            detail += f"; hashing alone (plan) {fmt_secs(side.plan)}"
        else:
            detail += f"; bare backend reads of the chunks {fmt_secs(side.reads_alone)}"
            if side.backend == "S3":
                detail += "; the store reads through a new, empty cache"
        rows.append(
            Row(
                GROUP,
                f"{op} {label}, {side.backend}: throughput vs fsspec {what}",
                f"{ratio:.2f}x",
                f">= {PUT_GET_GOAL}x",
                ratio >= PUT_GET_GOAL,
                detail,
            )
        )
    speedup = min(side.store_put) / min(side.reput)
    written = max(side.reput_written)
    rows.append(
        Row(
            GROUP,
            f"put the same {label} again, {side.backend}",
            f"{speedup:.1f}x faster, {written} B written",
            f">= {DEDUP_SPEEDUP_GOAL:.0f}x faster, 0 new bytes",
            speedup >= DEDUP_SPEEDUP_GOAL and written == 0,
            f"best second put {fmt_secs(min(side.reput))} vs best first {fmt_secs(min(side.store_put))}; "
            f"backend bytes written {written}, read {max(side.reput_read)} (the ref)",
        )
    )
    return rows


def overlap_row(ctx: Context) -> Row:
    from trajectory_replay.store import ObjectStore

    row_size = 64 * KiB
    n_rows = ctx.size(4096, 512)
    first_row = n_rows * 1000 // 4096
    count = n_rows // 2
    data = tensor_bytes(n_rows * row_size, seed=2)
    store = ObjectStore.open(str(ctx.path("overlap")))
    store.put(data, cuts=[i * row_size for i in range(n_rows)])
    second = data[first_row * row_size : (first_row + count) * row_size]
    del data
    chunks_before = store.stats.chunks_written
    dedup_before = store.stats.chunks_deduplicated
    chunk_bytes_before = store.stats.bytes_written
    settle()
    before = store.backend.stats.bytes_written
    ref = store.put(second, cuts=[i * row_size for i in range(count)])
    new = store.backend.stats.bytes_written - before
    fraction = new / len(second)
    chunk_bytes = store.stats.bytes_written - chunk_bytes_before
    assert store.get(ref) == second
    return Row(
        GROUP,
        f"overlapping rows: put rows {first_row}..{first_row + count - 1} of {n_rows} "
        f"({fmt_bytes(len(second))}) after all of them ({fmt_bytes(n_rows * row_size)})",
        f"{fraction * 100:.2f}% new",
        f"<= {OVERLAP_GOAL * 100:.0f}% new bytes",
        fraction <= OVERLAP_GOAL,
        f"{fmt_bytes(new)} written: {store.stats.chunks_written - chunks_before} new chunks "
        f"({fmt_bytes(chunk_bytes)}), {store.stats.chunks_deduplicated - dedup_before} reused, "
        f"record + ref {fmt_bytes(new - chunk_bytes)}",
    )


def ranged_read_row(ctx: Context, target: S3Target, ref, data: bytes) -> Row:
    from trajectory_replay.store import ObjectStore
    from trajectory_replay.store.digest import object_key
    from trajectory_replay.store.objectstore import DEFAULT_BLOCK_SIZE

    store = ObjectStore.open(target.url(0), cache_dir=str(ctx.path("cold-cache")), **target.options)
    record_size = store.backend.size(object_key(ref.record))
    store.backend.stats.reset()
    start = ref.size // 2 + 5000
    end = start + MiB
    t, out = timed(lambda: store.read_range(ref, start, end))
    assert out == data[start:end], "read_range returned different bytes"
    fetched, requests = store.backend.stats.bytes_read, store.backend.stats.reads
    bound = MiB + 2 * DEFAULT_BLOCK_SIZE + record_size
    return Row(
        GROUP,
        f"read_range 1 MiB from the middle of {fmt_bytes(ref.size)}, S3, cold cache",
        f"{fetched} B fetched",
        f"<= {bound} B (1 MiB + 2 blocks + record)",
        fetched <= bound,
        f"{fmt_bytes(fetched)} in {requests} requests ({fmt_secs(t)}): record {fmt_bytes(record_size)}, "
        f"blocks {fmt_bytes(fetched - record_size)}; "
        f"fetched / bound = {fetched / bound:.3f}",
    )


def run(ctx: Context) -> list[Row]:
    size = ctx.size(512 * MiB, 32 * MiB)
    ctx.log(f"generating {fmt_bytes(size)} of tensor bytes")
    data = tensor_bytes(size, seed=1)
    rows: list[Row] = []

    local = measure_put_get(ctx, LocalTarget(ctx), data)
    rows += put_get_rows(local, size)

    s3 = S3Target(ctx)
    remote = measure_put_get(ctx, s3, data)
    rows += put_get_rows(remote, size)

    rows.append(ranged_read_row(ctx, s3, remote.refs[0], data))
    del data

    ctx.log("overlapping rows")
    rows.append(overlap_row(ctx))
    return rows
