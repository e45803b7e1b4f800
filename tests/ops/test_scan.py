"""`scan` with the local engine: counts, earliest divergence, incomplete and corrupt bundles, locally and on S3;
`--json` and `--html`; verdicts kept in the store (re-scan, new bundles, `--force`, a scan killed mid-run); a worker
that dies; bad input; and the other store commands next to the verdicts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.ops.scan_helpers import CLEAN, DIVERGED, INCOMPLETE, check_summary, cli, cli_json, populate, write_step
from tests.ops.scan_workers import DiesOnceReplayer, DyingReplayer
from trajectory_replay.backends import open_backend
from trajectory_replay.bundle.markers import complete_key
from trajectory_replay.ops.scan import VERDICTS_DIR, scan_store
from trajectory_replay.store.layout import is_bundle_dir

REPO = Path(__file__).resolve().parents[2]
SLOW_NO_TORCH_CLI = "import sys; sys.modules['torch'] = None; from tests.ops.scan_workers import slow_cli; slow_cli()"
"""The CLI, whose workers replay slowly, in a process that cannot import torch: the scan driver never does (its
worker processes do)."""


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    """A local root of every kind of bundle, scanned by the tests of this module in order (only `gc` changes it: it
    removes the markers of the incomplete bundle, an abandoned cohort at --grace 0s)."""
    root = str(tmp_path_factory.mktemp("scan") / "store")
    populate(root)
    return root


def verdict_count(root: str) -> int:
    return len(open_backend(root).list(f"{VERDICTS_DIR}/"))


def test_local_scan_summary_json_and_text(store):
    code, summary = cli_json("scan", store, "--workers", "2")
    assert code == 1 and summary["status"] == "diverged"
    check_summary(summary)
    complete = len(CLEAN) + len(DIVERGED) + 1
    assert (summary["replayed"], summary["cached"]) == (complete, 0)
    assert summary["error"].startswith("s-2-1: diverged at reward.post_process")
    # pass, diverged are kept; the invalid one is not (it may be repaired), the incomplete one was not replayed
    assert verdict_count(store) == len(CLEAN) + len(DIVERGED)

    text = cli("scan", store)
    assert text.exit_code == 1
    out = text.stdout
    assert "7 bundle(s): 3 pass, 2 diverged, 1 invalid, 1 incomplete" in out
    assert "1 replayed, 5 from stored verdicts" in out  # only the invalid one is looked at again
    assert "earliest divergence: s-2-1 (step 2:1) at reward.post_process: sample s-0, field reward" in out
    assert "incomplete: partial (step 120:0): missing ranks [1] of [0, 1]" in out
    assert "s-3-0: invalid:" in out and "blake3:" in out  # the digest mismatch, named


def test_html_page(store, tmp_path):
    page = tmp_path / "scan.html"
    result = cli("scan", store, "--html", str(page))
    assert result.exit_code == 1
    assert f"wrote {page}" in result.stderr
    html = page.read_text(encoding="utf-8")
    assert "earliest divergence: s-2-1 (step 2:1) at reward.post_process: sample s-0" in html
    assert "verdict per bundle, in anchor order" in html and "<svg class='plot'" in html
    for name in ("s-1-0", "s-2-1", "s-3-0", "a-late", INCOMPLETE):
        assert name in html
    assert "<th>missing ranks</th>" in html and "[1]" in html


def test_resume_new_bundles_and_force(tmp_path):
    root = str(tmp_path / "store")
    populate(root, corrupt=False)
    first = scan_store(root, workers=2)
    assert (first.replayed, first.cached) == (5, 0) and first.exit_code == 1
    again = scan_store(root, workers=2)
    assert (again.replayed, again.cached) == (0, 5), "a re-scan replays nothing"
    check_summary(again.to_dict(), corrupt=False)
    write_step(root, "s-5-0", 5, 0)
    write_step(root, "s-0-0", 0, 0, buggy=True)
    more = scan_store(root, workers=2)
    assert (more.replayed, more.cached) == (2, 5), "only the new bundles are replayed"
    assert more.earliest_divergence.name == "s-0-0"
    forced = cli_json("scan", root, "--force", "--workers", "1")[1]
    assert (forced["replayed"], forced["cached"], forced["forced"]) == (7, 0, True)
    # other tolerances are other options: their verdicts are kept apart
    loose = scan_store(root, workers=1, atol=10.0)
    assert (loose.replayed, loose.counts["diverged"]) == (7, 0)


def test_killed_scan_is_resumed(tmp_path):
    root = str(tmp_path / "store")
    names = [f"s-{i}-0" for i in range(10)]
    for i, name in enumerate(names):
        write_step(root, name, i, 0)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    # the command as a user runs it, where the driver cannot import torch (only its workers do)
    proc = subprocess.Popen(
        [sys.executable, "-c", SLOW_NO_TORCH_CLI, "scan", root, "--workers", "1"],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 90
        while verdict_count(root) < 3 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None, "the scan ended before it could be killed"
        os.killpg(proc.pid, signal.SIGKILL)  # the scan and its workers, as a lost node would
        proc.wait(30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    time.sleep(0.2)
    done = verdict_count(root)
    assert 3 <= done < len(names)
    resumed = scan_store(root, workers=2)
    assert (resumed.cached, resumed.replayed) == (done, len(names) - done)
    assert resumed.counts["pass"] == len(names) and resumed.exit_code == 0


def test_worker_that_dies_is_retried_then_reported(tmp_path):
    root = str(tmp_path / "store")
    populate(root, corrupt=False)
    report = scan_store(root, workers=2, replayer=DyingReplayer)  # dies on s-1-1
    by_name = {v.name: v for v in report.verdicts}
    dead = by_name["s-1-1"]
    assert dead.status == "error" and dead.attempts == 2
    assert "exit code 17" in dead.detail and "tried 2 times" in dead.detail
    assert dead.anchor == "step 1:1"
    assert by_name["s-1-0"].status == "pass" and by_name["s-2-1"].status == "diverged"
    assert report.counts["error"] == 1 and report.exit_code == 1 and report.status == "diverged"
    after = scan_store(root, workers=2)
    assert after.replayed == 1 and after.counts["error"] == 0, "an error is not kept: it is replayed again"


def test_bundle_whose_worker_died_once_passes_on_a_fresh_worker(tmp_path):
    """One worker holding two bundles dies replaying the first: that one is replayed again on a fresh worker (its
    second try), the other goes back to the queue with no try spent, and nothing is reported as an error."""
    root = str(tmp_path / "store")
    populate(root, corrupt=False)
    report = scan_store(root, workers=1, replayer=DiesOnceReplayer)  # dies on s-1-1, the first time
    by_name = {v.name: v for v in report.verdicts}
    assert Path(f"{root}.died-s-1-1").exists()
    assert (by_name["s-1-1"].status, by_name["s-1-1"].attempts) == ("pass", 2)
    assert (by_name["s-2-1"].status, by_name["s-2-1"].attempts) == ("diverged", 1)  # held behind s-1-1
    assert all(v.attempts == 1 for v in report.verdicts if v.name != "s-1-1" and v.status != "incomplete")
    assert report.counts["error"] == 0 and report.status == "diverged"


def test_bad_input_is_one_line(tmp_path, monkeypatch):
    missing = cli("scan", str(tmp_path / "nothing"))
    assert missing.exit_code == 1 and "no such store root" in missing.stderr
    assert len(missing.stderr.strip().splitlines()) == 1
    for args, message in (
        (["--workers", "0"], "--workers 0: must be at least 1"),
        (["--engine", "spark"], "--engine 'spark': expected local or ray"),
        (["--atol", "nan"], "--atol nan"),
        (["--ray-address", "ray://x:1"], "--ray-address needs --engine ray"),
    ):
        bad = cli("scan", str(tmp_path), *args)
        assert bad.exit_code == 2 and message in bad.stderr, (args, bad.stderr)
        assert len(bad.stderr.strip().splitlines()) == 1
    memory = cli("scan", "memory://somewhere")
    assert memory.exit_code == 2 and "memory:// store lives in this process only" in memory.stderr
    code, out = cli_json("scan", str(tmp_path), "--workers", "-3")
    assert code == 2 and out["status"] == "usage"
    monkeypatch.setitem(sys.modules, "ray", None)  # as where ray is not installed
    noray = cli("scan", str(tmp_path), "--engine", "ray")
    assert noray.exit_code == 2
    assert "--engine ray needs ray" in noray.stderr and "trajectory-replay[ray]" in noray.stderr
    empty = tmp_path / "empty-root"
    write_step(str(empty), "x", 1, 0)
    open_backend(str(empty)).delete(complete_key("x"))  # a directory, but no bundle in it
    none = cli("scan", str(empty))
    assert none.exit_code == 1 and "no bundles found" in none.stderr


def test_store_commands_ignore_verdicts(store, tmp_path):
    """ls, stats, fsck, gc and cp see the same bundles with the verdicts there; gc keeps the verdicts."""
    assert verdict_count(store) > 0
    code, listed = cli_json("ls", store)
    assert code == 0 and VERDICTS_DIR not in [b["name"] for b in listed["bundles"]]
    assert len(listed["bundles"]) == 7
    code, stats = cli_json("stats", store)
    assert code == 0
    code, fsck = cli_json("fsck", store)
    assert code == 1 and all(VERDICTS_DIR not in json.dumps(b) for b in fsck["damaged_bundles"])
    assert all(not k.startswith(VERDICTS_DIR) for k in fsck["missing"] + fsck["corrupt"])
    before = verdict_count(store)
    code, gc = cli_json("gc", store, "--grace", "0s")
    assert code == 0 and not [k for k in gc["removed"] if k.startswith(VERDICTS_DIR)]
    assert verdict_count(store) == before, "gc keeps the verdicts"
    dest = str(tmp_path / "copy")
    code, copied = cli_json("cp", store, dest, "--step", "1:0")
    assert code == 0, copied
    assert not open_backend(dest).list(f"{VERDICTS_DIR}/"), "cp copies bundles, not verdicts"


@pytest.mark.s3
def test_s3_scan(s3_root, s3_env):
    url, options = s3_root
    populate(url, options)
    code, summary = cli_json("scan", url, "--workers", "2")  # the AWS_* variables reach the workers
    assert code == 1
    check_summary(summary)
    assert (summary["replayed"], summary["cached"]) == (len(CLEAN) + len(DIVERGED) + 1, 0)
    again = scan_store(url, workers=1, **options)
    assert (again.replayed, again.cached) == (1, len(CLEAN) + len(DIVERGED))
    check_summary(again.to_dict())
    assert again.exit_code == 1


def test_progress_counts_bundles_and_divergences(store):
    """Every bundle reaches the progress (stored verdicts and incomplete bundles too); the bar shows done / total
    and the running count of divergences."""
    import io

    from rich.console import Console

    from trajectory_replay.ops.scan import RichScanProgress, ScanProgress

    class Recording(ScanProgress):
        def start(self, total):
            self.total, self.seen = total, []

        def done(self, verdict):
            self.seen.append((verdict.name, verdict.status))

    recording = Recording()
    report = scan_store(store, workers=1, progress=recording)
    n = len(report.verdicts)  # 7, or 6 after the gc test removed the abandoned cohort
    assert recording.total == len(recording.seen) == n and n in (6, 7)
    assert sorted(recording.seen) == sorted((v.name, v.status) for v in report.verdicts)
    out = io.StringIO()
    with RichScanProgress(Console(file=out, force_terminal=True, width=120)) as bar:
        bar.start(len(report.verdicts))
        for verdict in report.verdicts:
            bar.done(verdict)
    assert f"{n}/{n} bundles" in out.getvalue() and "2 diverged" in out.getvalue()


def test_a_store_that_takes_no_verdicts_is_still_scanned(tmp_path):
    """Verdicts that cannot be written (a store this user may only read) are still reported; the summary says they
    were not kept, and the next scan replays those bundles again."""
    root = tmp_path / "store"
    for i in range(3):
        write_step(str(root), f"s-{i}-0", i, 0, buggy=i == 1)
    (root / VERDICTS_DIR).write_bytes(b"not a directory")  # every verdict write fails
    report = scan_store(str(root), workers=1)
    assert report.counts["pass"] == 2 and report.counts["diverged"] == 1 and report.exit_code == 1
    assert len(report.unkept) == 3 and report.unkept[0].startswith("s-0-0: ")
    assert "3 verdict(s) not kept in the store" in report.render_text()
    assert scan_store(str(root), workers=1).replayed == 3


def test_a_torn_verdict_is_replayed_and_written_again(tmp_path):
    """A verdict left empty or cut short (a crash before the system wrote it out: verdicts are not flushed one by
    one) is ignored, its bundle replayed, and a sound verdict written in its place."""
    root = tmp_path / "store"
    for i in range(3):
        write_step(str(root), f"s-{i}-0", i, 0, buggy=i == 1)
    assert scan_store(str(root), workers=1).replayed == 3
    stored = sorted((root / VERDICTS_DIR).iterdir())
    assert len(stored) == 3
    sound = stored[0].read_bytes()
    stored[0].write_bytes(b"")
    stored[1].write_bytes(stored[1].read_bytes()[:10])
    again = scan_store(str(root), workers=1)
    assert (again.replayed, again.cached) == (2, 1) and again.unkept == []
    assert stored[0].read_bytes() == sound
    assert (again.counts["pass"], again.counts["diverged"]) == (2, 1)
    assert (scan_store(str(root), workers=1).replayed, scan_store(str(root), workers=1).cached) == (0, 3)


def test_concurrent_scans_agree_and_keep_sound_verdicts(tmp_path):
    root = str(tmp_path / "store")
    populate(root, corrupt=False)
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        reports = list(pool.map(lambda _: scan_store(root, workers=1), range(2)))
    outcomes = [[(v.name, v.status, v.first_divergent_stage, v.sample_id) for v in r.verdicts] for r in reports]
    assert outcomes[0] == outcomes[1]
    after = scan_store(root, workers=1)
    assert (after.replayed, after.cached) == (0, 5), "every verdict either scan wrote reads back"
    assert [(v.name, v.status, v.first_divergent_stage, v.sample_id) for v in after.verdicts] == outcomes[0]


def test_an_unreachable_ray_cluster_is_one_line(tmp_path):
    pytest.importorskip("ray")
    root = str(tmp_path / "store")
    write_step(root, "s-1-0", 1, 0)
    result = cli("scan", root, "--engine", "ray", "--ray-address", "127.0.0.1:1")
    assert result.exit_code == 1, result.output  # the cluster, not the command line: 2 is for malformed lines
    assert result.stderr.strip().splitlines() == [
        "trajectory-replay: error: cannot reach the Ray cluster at 127.0.0.1:1: Connection refused (check "
        "--ray-address or RAY_ADDRESS)"
    ]


def _verdict_files(root: Path) -> dict[str, Path]:
    """Stored verdict files by bundle name (each holds the digest of its bundle's COMPLETE)."""
    from trajectory_replay.ops.scan import ScanOptions, bundle_digest, verdict_key

    backend = open_backend(str(root))
    names = [p.name for p in root.iterdir() if is_bundle_dir(p.name) and p.is_dir()]
    out = {}
    for name in names:
        if backend.exists(complete_key(name)):
            key = verdict_key(bundle_digest(backend.read(complete_key(name))), ScanOptions())
            if backend.exists(key):
                out[name] = root / key
    return out


def test_a_stored_pass_is_not_reused_for_a_bundle_damaged_after_the_scan(tmp_path, monkeypatch):
    """A payload's chunk rewritten with other bytes of its size, or removed, after a scan passed the bundle: the
    next scan without --force replayed nothing and reported `pass` from the stored verdict. The verdict holds the
    stamp of the bundle's objects, and a bundle whose objects changed is replayed (and found invalid)."""
    from tests.ops.scan_helpers import corrupt_payload
    from trajectory_replay.bundle.status import bundle_status
    from trajectory_replay.ops.walk import Walker
    from trajectory_replay.store.digest import object_key

    monkeypatch.setenv("TRAJECTORY_REPLAY_CACHE_DIR", str(tmp_path / "cache"))
    root = tmp_path / "store"
    for i in range(3):
        write_step(str(root), f"s-{i}-0", i, 0, current_logprob=0.31 + 0.01 * i)  # log-probs of their own
    first = scan_store(str(root), workers=1)
    assert (first.replayed, first.counts["pass"]) == (3, 3)
    corrupt_payload(str(root), "s-0-0", "log_probs")
    backend = open_backend(str(root))
    tree = Walker(backend).trees([bundle_status(backend, "s-1-0")])["s-1-0"]
    chunk = next(c for _, spec, node in tree.payloads if spec.name == "log_probs" for c, _ in node.chunks)
    backend.delete(object_key(chunk))
    again = scan_store(str(root), workers=1)
    by_name = {v.name: v for v in again.verdicts}
    assert (again.replayed, again.cached) == (2, 1)
    assert by_name["s-0-0"].status == "invalid" and not by_name["s-0-0"].cached
    assert by_name["s-1-0"].status == "invalid" and not by_name["s-1-0"].cached
    assert by_name["s-2-0"].status == "pass" and by_name["s-2-0"].cached
    assert again.status == "invalid" and again.exit_code == 1


def test_only_verdicts_this_users_scans_wrote_are_trusted(tmp_path, monkeypatch):
    """A verdict rewritten to `pass` in the store was reported as the bundle's outcome. Verdicts carry a MAC
    under a key kept in the user's cache directory (mode 0600): one edited in the store, or written by a scan
    with another key, is not trusted and its bundle is replayed."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("TRAJECTORY_REPLAY_CACHE_DIR", str(cache))
    root = tmp_path / "store"
    write_step(str(root), "s-0-0", 0, 0)
    write_step(str(root), "s-1-0", 1, 0, buggy=True)
    assert scan_store(str(root), workers=1).counts["diverged"] == 1
    key_file = cache / "scan-verdicts.key"
    assert key_file.stat().st_mode & 0o777 == 0o600 and len(key_file.read_bytes()) == 32
    files = _verdict_files(root)
    forged = json.loads(files["s-1-0"].read_bytes())
    forged["verdict"].update(
        status="pass", first_divergent_stage=None, rank=None, sample_id=None, field=None, token_offset=None, detail=""
    )
    files["s-1-0"].write_text(json.dumps(forged))
    again = scan_store(str(root), workers=1)
    by_name = {v.name: v for v in again.verdicts}
    assert (again.replayed, again.cached) == (1, 1)
    assert by_name["s-1-0"].status == "diverged" and not by_name["s-1-0"].cached
    assert by_name["s-0-0"].status == "pass" and by_name["s-0-0"].cached

    monkeypatch.setenv("TRAJECTORY_REPLAY_CACHE_DIR", str(tmp_path / "other-user"))  # another key
    other = scan_store(str(root), workers=1)
    assert (other.replayed, other.cached) == (2, 0)
    assert [v.status for v in other.verdicts] == ["pass", "diverged"]


def test_without_a_key_for_verdicts_every_bundle_is_replayed_and_none_kept(tmp_path, monkeypatch):
    """A cache directory where the key can be neither read nor made (here: a file in its place): the scan still
    judges every bundle, says why no verdict was kept, and trusts none of the stored ones."""
    root = tmp_path / "store"
    write_step(str(root), "s-0-0", 0, 0)
    monkeypatch.setenv("TRAJECTORY_REPLAY_CACHE_DIR", str(tmp_path / "cache"))
    assert scan_store(str(root), workers=1).replayed == 1  # a verdict kept under a key
    (tmp_path / "not-a-dir").write_bytes(b"")
    monkeypatch.setenv("TRAJECTORY_REPLAY_CACHE_DIR", str(tmp_path / "not-a-dir" / "cache"))
    report = scan_store(str(root), workers=1)
    assert (report.replayed, report.cached, report.counts["pass"]) == (1, 0, 1)
    assert len(report.unkept) == 1 and report.unkept[0].startswith("s-0-0: no key for verdicts: ")
