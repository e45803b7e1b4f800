"""Replay benchmarks: recompute cost against validate, peak memory, and bytes fetched for one group on S3."""

from __future__ import annotations

import json
import subprocess
import sys

from benchmarks.common import Context, Row, fmt_bytes, fmt_secs, median
from benchmarks.data import GROUP_SIZE, big_case

GROUP = "replay"
TITLE = "replay: recompute, memory, lazy remote reads"
HOW = """\
The 2,048 x 2,048 bundle of the bundle benchmarks, on local disk. Each command runs in a fresh
Python process; its net time is its wall time minus that of a process doing only the bare
`import torch, trajectory_replay` (measured interleaved, medians). **replay vs validate**: full
replay (all six stages) against `validate`, which reads and verifies every payload. **memory**:
peak RSS (`ru_maxrss`) of a process running the replay, minus its resident size right after the bare import,
against the payload bytes. **S3 group**: replay of one group whose members are scattered across
the bundle, by `s3://` URL with an empty cache; every byte fetched at the backend counts."""

_TIMED = r"""
import sys, time, resource
t0 = time.perf_counter()
import torch, trajectory_replay
from trajectory_replay.bundle import open_sources
from trajectory_replay.replay import replay
from trajectory_replay.replay.validate import validate_sources
imported = time.perf_counter()
import os
with open("/proc/self/statm") as f:  # resident now, after the import (its transient peak may be higher)
    base_rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
mode, path = sys.argv[1], sys.argv[2]
if mode == "replay":
    ok = replay(open_sources(path)).passed
elif mode == "validate":
    ok = validate_sources(path, open_sources(path)).valid
else:
    ok = True
done = time.perf_counter()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print({"net": done - imported, "total": done - t0, "import": imported - t0, "ok": ok,
       "base_rss": base_rss, "peak_rss": peak}.__repr__())
"""


def _measure(mode: str, path: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _TIMED, mode, path], capture_output=True, text=True, check=True)
    return eval(out.stdout.strip().splitlines()[-1])  # noqa: S307 - our own child's repr of a dict of numbers


def run(ctx: Context) -> list[Row]:
    from trajectory_replay.bundle import BundleWriter, open_sources
    from trajectory_replay.replay import replay

    n = ctx.size(2048, 256)
    case = big_case(n, 2048)
    local = ctx.path("replay")
    writer = BundleWriter(local / "big", case.manifest, case.index, case.expected)
    for name, tensor in case.payloads.items():
        writer.write_payload(name, tensor)
    writer.finalize()
    payload_bytes = sum(t.numel() * t.element_size() for t in case.payloads.values()) + case.loss_masks.numel()
    path = str(local / "big")

    samples: dict[str, list[dict]] = {"import": [], "replay": [], "validate": []}
    for _ in range(ctx.reps(3)):
        for mode in samples:
            samples[mode].append(_measure(mode, path))
    assert all(s["ok"] for s in samples["replay"]), "the benchmark bundle must replay with a pass"
    imp = median([s["total"] for s in samples["import"]])
    replay_net = median([s["total"] for s in samples["replay"]]) - imp
    validate_net = median([s["total"] for s in samples["validate"]]) - imp
    ratio = replay_net / validate_net
    rows = [Row(GROUP, f"full replay vs validate, {n}x2048 local, net of bare import", f"{ratio:.2f}x",
                "<= 1.5x", ratio <= 1.5,
                f"replay {fmt_secs(replay_net)}, validate {fmt_secs(validate_net)}, import {fmt_secs(imp)}")]
    extra = median([s["peak_rss"] - s["base_rss"] for s in samples["replay"]])
    mem_ratio = extra / payload_bytes
    rows.append(Row(GROUP, "replay peak memory above bare import", f"{mem_ratio:.2f}x payload bytes",
                    "<= 2x", mem_ratio <= 2.0, f"{fmt_bytes(extra)} above import, payloads {fmt_bytes(payload_bytes)}"))

    bucket = ctx.s3_bucket()
    options = ctx.s3_options()
    url = f"s3://{bucket}/run/big"
    writer = BundleWriter(url, case.manifest, case.index, case.expected, cache_dir=str(ctx.path("wcache")),
                          **options)
    for name, tensor in case.payloads.items():
        writer.write_payload(name, tensor)
    writer.finalize()
    sources = open_sources(url, cache_dir=str(ctx.path("cold")), **options)
    stats = sources[0].store.backend.stats
    group = f"g-{3}"
    report = replay(sources, groups=[group])
    fetched = stats.bytes_read
    share = fetched / payload_bytes
    statuses = json.dumps({s.stage: s.status for s in report.stages})
    rows.append(Row(GROUP, f"replay one scattered group ({GROUP_SIZE} samples) by s3:// URL, cold cache",
                    f"{share:.2%} of payload bytes", "<= 3%", share <= 0.03 and report.passed,
                    f"{fmt_bytes(fetched)} fetched of {fmt_bytes(payload_bytes)}; {statuses}"))
    return rows
