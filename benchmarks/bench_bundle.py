"""Bundle benchmarks: write cost against the bare store, and bytes fetched for one scattered group."""

from __future__ import annotations

from benchmarks.common import Context, Row, fmt_bytes, fmt_secs, median, timed
from benchmarks.data import GROUP_SIZE, big_case

GROUP = "bundle"
TITLE = "bundle: writer and lazy reader"
HOW = """\
A bundle of 2,048 samples x 2,048 response tokens (six float32 per-token payloads plus the uint8
loss mask, about 100 MB) on the S3 server. **write**: `BundleWriter` (safetensors encoding, row
cuts, in-flight record, documents, completion marker) against `ObjectStore.put` of the same six
tensors' bytes plus the mask, with the same sample-row cut points, into a fresh prefix: what the
bundle layer adds over the store. Interleaved, median of the repetitions.
**group read**: a fresh reader with an empty cache opens the bundle by URL and loads the rows of
the 8 members of one group (scattered across the bundle) from every payload; every byte fetched
at the backend counts (markers, documents, records, headers, blocks) against the payload bytes."""


def run(ctx: Context) -> list[Row]:
    from trajectory_replay.bundle import BundleReader, BundleWriter
    from trajectory_replay.store import ObjectStore

    n = ctx.size(2048, 256)
    case = big_case(n, 2048)
    bucket = ctx.s3_bucket()
    options = ctx.s3_options()
    writes, puts = [], []
    for rep in range(ctx.reps(3)):

        def write_bundle(prefix=f"s3://{bucket}/w{rep}"):
            w = BundleWriter(
                f"{prefix}/big", case.manifest, case.index, case.expected, cache_dir=str(ctx.path("cache")), **options
            )
            for name, tensor in case.payloads.items():
                w.write_payload(name, tensor)
            w.finalize()

        def bare_put(prefix=f"s3://{bucket}/p{rep}"):
            store = ObjectStore.open(prefix, cache_dir=str(ctx.path("cache")), **options)
            for tensor in [*case.payloads.values(), case.loss_masks]:
                row = tensor.numel() // n * tensor.element_size()  # the same row cuts the writer gives
                store.put(memoryview(tensor.numpy()).cast("B"), cuts=list(range(0, row * n, row)))

        puts.append(timed(bare_put)[0])
        writes.append(timed(write_bundle)[0])
        ctx.log(f"write {writes[-1]:.2f}s vs bare put {puts[-1]:.2f}s")
    ratio = median(writes) / median(puts)
    rows = [
        Row(
            GROUP,
            f"write {n}x2048 bundle vs bare ObjectStore.put, S3",
            f"{ratio:.2f}x",
            "<= 1.2x",
            ratio <= 1.2,
            f"write {fmt_secs(median(writes))}, put {fmt_secs(median(puts))}",
        )
    ]

    url = f"s3://{bucket}/w0/big"
    reader = BundleReader.open(url, cache_dir=str(ctx.path("cold")), **options)
    stats = reader.store.backend.stats
    opened = stats.bytes_read
    members = [i for i, s in enumerate(reader.index.samples) if s.group_index == 3]
    assert len(members) == GROUP_SIZE
    for name in reader.manifest.payloads:
        reader.load_payload(name, samples=members)
    fetched = stats.bytes_read
    payload_bytes = sum(s.size for s in reader.manifest.payloads.values())
    share = fetched / payload_bytes
    rows.append(
        Row(
            GROUP,
            f"read one scattered group of {GROUP_SIZE}, all payloads, S3 cold cache",
            f"{share:.2%} of payload bytes",
            "<= 3%",
            share <= 0.03,
            f"{fmt_bytes(fetched)} fetched (open {fmt_bytes(opened)}) of {fmt_bytes(payload_bytes)}",
        )
    )
    return rows
