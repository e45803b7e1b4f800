"""Streaming replay: a cohort replayed in blocks of whole groups reports exactly what one block reports.

Every kind of bundle replay supports is replayed twice, in one block and in blocks of a few tokens (so every
group lands in a block of its own or shares one with a neighbour), and the two reports must be equal field
for field, evidence included, clean or with faults.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from tests.replay.cases import split_ranks, twelve_case
from tests.replay.conftest import MemorySource, source_of
from tests.replay.reference64 import GROUPS, algorithm_case, token_position, token_with_mask
from trajectory_replay.bundle.schema import StageId
from trajectory_replay.replay import replay
from trajectory_replay.replay.blocks import plan_blocks
from trajectory_replay.replay.cohort import Cohort, CohortPart, PayloadCache
from trajectory_replay.replay.fixtures import CanonicalCase

SMALL = 6
"""Block size in tokens: each block holds about one group of the random cases."""

CONFIGS = {
    "grpo": {},
    "grpo-std-biased": {"grpo_std_normalization": True, "std_unbiased": False},
    "dr_grpo-seq-mean-token-mean": {"advantage_estimator": "dr_grpo", "loss_agg_mode": "seq_mean_token_mean"},
    "rloo-token-mean-denominator": {
        "advantage_estimator": "rloo",
        "loss_agg_mode": "token_mean",
        "loss_denominator": 80,
    },
    "rf++-kl-in-reward": {
        "advantage_estimator": "reinforce_plus_plus",
        "gamma": 0.9,
        "kl_coef": 0.1,
        "kl_in_reward": True,
    },
    "rf++-baseline": {"advantage_estimator": "reinforce_plus_plus_baseline"},
    "gae-value": {
        "advantage_estimator": "gae",
        "gamma": 0.99,
        "lam": 0.95,
        "kl_coef": 0.05,
        "kl_in_reward": True,
        "cliprange_value": 0.2,
    },
    "gspo-seq-mean-token-sum": {"policy_loss": "gspo", "loss_agg_mode": "seq_mean_token_sum"},
    "cispo-norm": {"policy_loss": "cispo", "loss_agg_mode": "seq_mean_token_sum_norm", "loss_scale_factor": 8},
    "dual-clip-kl-loss": {"eps_clip_c": 3.0, "kl_loss_coef": 0.1, "kl_loss_estimator": "low_var_kl"},
    "rollout-is-token-rs-sequence": {
        "rollout_is": "token",
        "rollout_rs": "sequence",
        "rollout_rs_lower": 0.5,
        "rollout_rs_upper": 2.0,
        "loss_agg_mode": "token_mean",
    },
    "rollout-is-sequence-ceilings": {
        "rollout_is": "sequence",
        "mismatch_max_token_log_ratio": 0.5,
        "mismatch_max_kl_k3": 0.001,
    },
    "on-policy": {"expect_on_policy": True},
}


def _both(sources: list, **options: Any) -> tuple[dict, dict]:
    """The report of one block and of blocks of SMALL tokens, as dicts with every stage's evidence."""
    whole = replay(sources, **options)
    streamed = replay(sources, block_tokens=SMALL, **options)

    def as_dict(report) -> dict:
        return {
            "report": report.to_dict(),
            "evidence": [s.evidence for s in report.stages],
            "metrics": [s.metrics for s in report.stages],
        }

    return as_dict(whole), as_dict(streamed)


def _with_payload(case: CanonicalCase, name: str, position: int, delta: float) -> CanonicalCase:
    payloads = dict(case.payloads)
    payloads[name] = payloads[name].clone()
    payloads[name][position] += delta
    return CanonicalCase(case.manifest, case.index, case.expected, payloads)


def _blocks_of(source) -> list:
    cohort = Cohort([CohortPart(source, tuple(range(len(source.index.samples))))], PayloadCache())
    return plan_blocks(cohort, SMALL)


@pytest.mark.parametrize("config", list(CONFIGS.values()), ids=list(CONFIGS))
def test_streamed_replay_equals_the_replay_in_one_block(config):
    case = algorithm_case(config, seed=7)
    source = source_of(case)
    assert len(_blocks_of(source)) >= 3
    whole, streamed = _both([source])
    assert streamed == whole


@pytest.mark.parametrize(
    "config",
    [CONFIGS["grpo"], CONFIGS["gae-value"], CONFIGS["rf++-kl-in-reward"], CONFIGS["rollout-is-token-rs-sequence"]],
    ids=["grpo", "gae", "rf++", "rollout-is"],
)
def test_streamed_faults_are_found_at_the_same_stage_sample_and_token(config):
    case = algorithm_case(config, seed=3)
    late = token_position(case.index, 10, token_with_mask(case.index, 10))
    early = token_position(case.index, 2, token_with_mask(case.index, 2))
    faulty = _with_payload(_with_payload(case, "kl", late, 0.5), "kl", early, 0.25)
    faulty = _with_payload(faulty, "entropy", early, float("nan"))
    if "rollout_log_probs" in faulty.payloads:
        faulty = _with_payload(faulty, "rollout_log_probs", late, float("inf"))
    whole, streamed = _both([source_of(faulty)])
    assert streamed == whole
    assert not whole["report"]["passed"]
    kl = next(s for s in whole["report"]["stages"] if s["stage"] == "advantage.kl")
    assert kl["status"] == "fail"


def test_streamed_advantage_faults_keep_their_evidence_and_order():
    case = algorithm_case({"grpo_std_normalization": True}, seed=5)
    faulty = case
    for sample in (11, 0, 6, 3):  # written out of order, across blocks
        faulty = _with_payload(faulty, "advantages", token_position(case.index, sample, 0), 1.0)
    whole, streamed = _both([source_of(faulty)])
    assert streamed == whole
    stage = next(s for s in whole["report"]["stages"] if s["stage"] == "advantage.estimate")
    assert [d["sample_id"] for d in stage["divergences"]][:2] == ["a-0", "a-3"]


def test_streamed_multi_rank_and_partial_selections_equal_one_block():
    case = twelve_case()
    shards = split_ranks(case, [[0, 2, 4, 6, 8, 10], [1, 3, 5, 7, 9, 11]])
    sources = [MemorySource(*shard, rank=r) for r, shard in enumerate(shards)]
    whole, streamed = _both(sources)
    assert streamed == whole and whole["report"]["passed"]
    whole, streamed = _both(sources, groups=["g-0"])
    assert streamed == whole
    whole, streamed = _both(sources, rank=1)
    assert streamed == whole


def test_a_block_holds_whole_groups_and_reads_only_its_rows():
    case = algorithm_case({}, seed=1)
    source = source_of(case)
    blocks = _blocks_of(source)
    assert len(blocks) == len(set(GROUPS))  # the groups of 4 members each exceed SMALL tokens: one a block
    for block in blocks:
        groups = {r.group_index for r in block.cohort.records}
        members = [i for i, g in enumerate(GROUPS) if g in groups]
        assert block.index.tolist() == members  # every member of its groups, in cohort order
    assert replay([source], block_tokens=SMALL).passed
    read = {rows for _, rows in source.loads if rows is not None}
    assert read  # every read is of some rows, and those rows are whole groups
    for rows in read:
        groups = {GROUPS[i] for i in rows}
        assert set(rows) == {i for i, g in enumerate(GROUPS) if g in groups}


def test_a_malformed_bundle_is_replayed_in_one_block():
    case = algorithm_case({}, seed=2)
    payloads = dict(case.payloads)
    payloads["entropy"] = payloads["entropy"][:-1]
    whole, streamed = _both([source_of(CanonicalCase(case.manifest, case.index, case.expected, payloads))])
    assert streamed == whole and not whole["report"]["passed"]


def test_the_streamed_replay_reads_every_payload_row_once_per_pass():
    case = algorithm_case(CONFIGS["gae-value"], seed=4)
    source = source_of(case)
    assert replay([source], block_tokens=SMALL).passed
    per_name: dict[str, int] = {}
    for name, rows in source.loads:
        per_name[name] = per_name.get(name, 0) + (len(rows) if rows is not None else len(case.index.samples))
    # gae whitens over the cohort: the payloads up to advantage.estimate are read twice (statistics, then replay)
    assert per_name["values"] == 2 * len(case.index.samples)
    assert per_name["vpreds"] == len(case.index.samples)
    assert StageId.LOSS_VALUE.value in {s.stage for s in replay([source], block_tokens=SMALL).stages}


def test_zero_length_responses_stream_too():
    case = algorithm_case({"advantage_estimator": "gae", "cliprange_value": 0.2}, seed=9, empty_sample=True)
    faulty = _with_payload(case, "advantages", token_position(case.index, 2, 0), 0.5)
    whole, streamed = _both([source_of(faulty)])
    assert streamed == whole and not whole["report"]["passed"]


def test_the_cli_streams_a_stored_bundle_with_the_same_report(tmp_path):
    """A bundle on disk, replayed by the CLI in one block and in blocks of 6 tokens (ranged reads of each block's
    rows, the next block read while the current one computes): the same JSON report, faults included."""
    import json

    from typer.testing import CliRunner

    from trajectory_replay.bundle import BundleWriter
    from trajectory_replay.cli import app

    case = algorithm_case(CONFIGS["gae-value"], seed=11)
    faulty = _with_payload(case, "advantages", token_position(case.index, 9, 0), 0.5)
    writer = BundleWriter(tmp_path / "b", faulty.manifest, faulty.index, faulty.expected)
    for name, tensor in faulty.payloads.items():
        writer.write_payload(name, tensor)
    writer.finalize()
    runner = CliRunner()
    whole = runner.invoke(app, ["replay", str(tmp_path / "b"), "--json"])
    streamed = runner.invoke(app, ["replay", str(tmp_path / "b"), "--json", "--block-tokens", str(SMALL)])
    assert whole.exit_code == streamed.exit_code == 1
    assert json.loads(streamed.stdout) == json.loads(whole.stdout)
    bad = runner.invoke(app, ["replay", str(tmp_path / "b"), "--block-tokens", "0"])
    assert bad.exit_code == 2 and "--block-tokens must be a positive number of tokens" in bad.output


@pytest.fixture
def cpus(monkeypatch):
    """Set how many CPUs a replay takes as free ($TRAJECTORY_REPLAY_THREADS, and torch's threads, which cap them):
    the thread ahead runs only beside a kernel thread of its own, whatever the host and its load."""
    import torch

    from trajectory_replay.cpus import THREADS_ENV

    def given(n: int) -> None:
        monkeypatch.setenv(THREADS_ENV, str(n))
        torch.set_num_threads(n)

    before = torch.get_num_threads()
    yield given
    torch.set_num_threads(before)


def _recorded_reads(tmp_path, monkeypatch, helper: bool) -> tuple[list[str], list[str]]:
    """Replay a local bundle in blocks; the threads that read chunks in this process and those that asked the
    reading process (`store.reading_process`) for them."""
    import threading
    import time

    from benchmarks.bench_scale import write_case
    from trajectory_replay.backends.local import LocalBackend
    from trajectory_replay.bundle import open_for_replay
    from trajectory_replay.replay import runner
    from trajectory_replay.store import reading_process

    write_case(tmp_path / "b", 256, 2048)
    here: list[str] = []
    asked: list[str] = []
    read_into, helper_read = LocalBackend.read_into, reading_process.ReadingProcess.read

    def recording(self, key, target):
        here.append(threading.current_thread().name)
        return read_into(self, key, target)

    def asking(self, items):
        asked.append(threading.current_thread().name)
        return helper_read(self, items)

    # the losses take a while on each block, as on a real one: the thread ahead has begun the next block by the time
    # this thread takes it (a block it has not begun is read here: on a loaded host, with these tiny blocks, the
    # caller could otherwise overtake it)
    per_part = runner._PassRunner._per_part

    def slow(self, *args, **kwargs):
        time.sleep(0.02)
        return per_part(self, *args, **kwargs)

    sources, rank = open_for_replay(str(tmp_path / "b"))  # the manifest and index: read here, before the replay
    monkeypatch.setattr(LocalBackend, "read_into", recording)
    monkeypatch.setattr(reading_process.ReadingProcess, "read", asking)
    monkeypatch.setattr(runner._PassRunner, "_per_part", slow)
    if not helper:
        monkeypatch.delattr(os, "memfd_create", raising=False)
    assert replay(sources, rank=rank, block_tokens=1 << 17).passed
    return here, asked


def test_a_local_bundle_is_read_by_the_reading_process_for_the_thread_ahead(tmp_path, monkeypatch, cpus):
    """A local bundle's whole chunks are read and hashed by the reading process, asked by the thread ahead alone,
    the first block's included: nothing in this process competes with the kernels for the cores or the lock."""
    cpus(2)
    here, asked = _recorded_reads(tmp_path, monkeypatch, helper=True)
    assert asked and {name.split("_")[0] for name in asked} == {"replay-ahead"}, set(asked)
    assert here == []


def test_without_a_reading_process_the_thread_ahead_reads_a_local_bundle_on_its_own(tmp_path, monkeypatch, cpus):
    """Where no reading process can run, a local bundle's chunks are read and hashed on the thread ahead alone: no
    pool threads competing with the kernels for the cores."""
    cpus(2)
    here, asked = _recorded_reads(tmp_path, monkeypatch, helper=False)
    assert asked == []
    # from the first block on: the payloads the stages may read under the config are known before any runs
    assert here and {name.split("_")[0] for name in here} == {"replay-ahead"}, set(here)


def test_with_one_cpu_free_a_streamed_replay_reads_and_computes_on_the_callers_thread_alone(
    tmp_path, monkeypatch, cpus
):
    """With one CPU free, a thread ahead, a reading process or a pool of readers would only take turns with the
    kernels on it: every chunk is read and hashed on the caller's thread, and the kernels run on one thread."""
    import threading

    import torch

    from trajectory_replay.cpus import THREADS_ENV
    from trajectory_replay.replay import runner

    cpus(2)
    monkeypatch.setenv(THREADS_ENV, "1")  # torch would run two threads: one CPU is free
    seen = []  # (thread, torch's threads) of every stage computation
    compute = runner._PassRunner._compute
    monkeypatch.setattr(
        runner._PassRunner,
        "_compute",
        lambda *a: (seen.append((threading.current_thread().name, torch.get_num_threads())), compute(*a))[1],
    )
    before = torch.get_num_threads()
    here, asked = _recorded_reads(tmp_path, monkeypatch, helper=True)
    assert asked == [] and here and set(here) == {threading.main_thread().name}, set(here)
    assert seen and set(seen) == {(threading.main_thread().name, 1)}, set(seen)
    assert torch.get_num_threads() == before == 2  # given back after the pass


def _stage_threads(monkeypatch) -> list[tuple[str, str]]:
    """Record (stage, thread name) of every stage computation from now on."""
    import threading

    from trajectory_replay.replay import runner

    seen: list[tuple[str, str]] = []
    compute = runner._PassRunner._compute

    def recording(self, planned, ctx, outputs, runs, block):
        seen.append((planned.stage.id.value, threading.current_thread().name))
        return compute(self, planned, ctx, outputs, runs, block)

    monkeypatch.setattr(runner._PassRunner, "_compute", recording)
    return seen


@pytest.mark.parametrize("slow", ["losses", "reads"])
def test_the_thread_ahead_and_the_caller_share_each_blocks_stages_and_agree(monkeypatch, slow, cpus):
    """A block's sample-level stages run on the thread ahead while the losses of the block before run on the
    caller's thread; when the reads are the slow side, the caller takes a block over mid-chain and runs the rest
    of its stages. Either way the report is the one of a single block."""
    import time

    cpus(2)

    from trajectory_replay.replay import runner

    # GAE (its estimate whitened over the cohort, from a first pass) when the losses are slow; RLOO (one pass)
    # when the reads are, so that every estimate on the caller's thread is one of the pass itself
    case = algorithm_case(CONFIGS["gae-value" if slow == "losses" else "rloo-token-mean-denominator"], seed=5)
    sources = [source_of(case)]
    whole = replay(sources).to_dict()
    seen = _stage_threads(monkeypatch)
    if slow == "losses":
        per_part = runner._PassRunner._per_part
        monkeypatch.setattr(runner._PassRunner, "_per_part", lambda *a, **k: (time.sleep(0.02), per_part(*a, **k))[1])
    else:
        read = runner._read
        monkeypatch.setattr(runner, "_read", lambda *a, **k: (time.sleep(0.05), read(*a, **k))[1])
    assert replay(sources, block_tokens=SMALL).to_dict() == whole
    ahead = {stage for stage, thread in seen if thread.startswith("replay-ahead")}
    here = {stage for stage, thread in seen if not thread.startswith("replay-ahead")}
    if slow == "losses":
        assert {"advantage.kl", "advantage.estimate"} <= ahead, seen
        assert "loss.policy" not in ahead  # cohort-level stages run on the caller's thread only
    else:
        # the first block runs here anyway; every later one is taken over as soon as its read is done
        assert sum(
            1 for stage, thread in seen if stage == "advantage.estimate" and not thread.startswith("replay-ahead")
        ) == len(_blocks_of(sources[0]))
        assert "advantage.estimate" in here


def test_a_failure_on_the_thread_ahead_surfaces_in_the_replay_and_leaves_no_thread(tmp_path, cpus):
    """A chunk damaged in the last block of a stored bundle: the thread ahead (through the reading process) meets it,
    the replay raises the integrity error a one-block replay raises, and no thread or process of the replay is left
    running."""
    import threading

    from benchmarks.bench_scale import write_case
    from trajectory_replay.bundle import open_for_replay
    from trajectory_replay.errors import IntegrityError
    from trajectory_replay.store import reading_process
    from trajectory_replay.store.digest import object_key

    cpus(2)
    write_case(tmp_path / "b", 256, 2048)
    sources, rank = open_for_replay(str(tmp_path / "b"))
    store = sources[0].store
    last = store.record(sources[0].manifest.payloads["log_probs"].digest).chunks[-1]
    store.backend.write(object_key(last.digest), b"\0" * last.size)
    with pytest.raises(IntegrityError, match=last.digest):
        replay(sources, rank=rank)
    sources, rank = open_for_replay(str(tmp_path / "b"))
    with pytest.raises(IntegrityError, match=last.digest):
        replay(sources, rank=rank, block_tokens=1 << 16)
    assert not [t for t in threading.enumerate() if t.name.startswith("replay-ahead")]
    assert reading_process._active is None  # and no reading process: it ended with the pass
