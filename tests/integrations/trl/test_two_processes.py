"""A TRL 1.16 GRPOTrainer trained by two processes, as a user launches it on CPU: `torchrun --nproc_per_node 2`
(torch.distributed over gloo; accelerate's `PartialState` sees the launcher's environment and runs
`DistributedType.MULTI_CPU`). Each process calls `enable_capture` on its own trainer into the same store, 2
optimizer steps; the rollout- and step-level bundles hold both ranks, replay clean linked step to rollout (sample
identity across the processes), and `conventions` names `profile trl`. One launch per setting (module-scoped),
every assertion on it in one test.

Run as a program, this file is what each launched process executes: `<file> STORE OUTPUT_DIR OPTIONS_JSON`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.integrations.trl import tiny
from trajectory_replay.bundle.resolve import open_for_replay
from trajectory_replay.integrations.trl import enable_capture
from trajectory_replay.replay import replay
from trajectory_replay.replay.chain import replay_chain

REPO = Path(__file__).resolve().parents[3]
PROCESSES = 2

SETTINGS: dict[str, dict[str, Any]] = {
    "dapo": {},
    "grpo": {"loss_type": "grpo"},
    "dapo, gradient_accumulation_steps=2": {"gradient_accumulation_steps": 2, "per_device_train_batch_size": 2},
}
"""GRPOConfig options of each launch. 4 completions per process and step (`per_device_train_batch_size` x
gradient accumulation): 2 prompts x 4 generations gathered over the processes per generation batch."""


def _process(store: str, output_dir: str, options: dict[str, Any]) -> None:
    """One launched process: a tiny GRPOTrainer with capture on (the default writer: a process of its own), 2 steps;
    its rank, the number of processes and the capture's counters written to `output_dir`."""
    t = tiny.trainer(output_dir, **{"per_device_train_batch_size": 4, **options})
    handle = enable_capture(t, store)
    t.train()
    written = handle.close(timeout=300)
    accelerator = t.accelerator
    info = {
        "rank": int(accelerator.process_index),
        "processes": int(accelerator.num_processes),
        "distributed_type": accelerator.distributed_type.value,
        "closed": written,
        "stats": handle.stats(),
    }
    Path(output_dir, f"rank-{info['rank']}.json").write_text(json.dumps(info, default=str))


@pytest.fixture(scope="module", params=list(SETTINGS), ids=list(SETTINGS))
def launched(request, tmp_path_factory) -> tuple[Path, Path, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("trl2")
    store, out = tmp / "store", tmp / "out"
    tiny.model().save_pretrained(str(out / "model"))  # once, before the processes that load it start
    options = SETTINGS[request.param]
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={PROCESSES}",
            __file__,
            str(store),
            str(out),
            json.dumps(options),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=str(tmp),
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return store, out, options


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trajectory_replay", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        check=False,
    )


def _failures(report: Any) -> list[tuple[Any, ...]]:
    return [(s.stage, s.rank, s.message) for s in report.stages if s.status != "pass"]


def test_two_processes_capture_one_run_that_replays_clean(launched):
    store, out, options = launched
    for rank in range(PROCESSES):
        info = json.loads((out / f"rank-{rank}.json").read_text())
        assert (info["rank"], info["processes"], info["distributed_type"]) == (rank, PROCESSES, "MULTI_CPU")
        assert info["closed"] and info["stats"]["errors"] == 0, info
        assert info["stats"]["written"] == 4, info  # its part of rollout-0, rollout-1, step-0-0, step-1-0

    names = sorted(p.name for p in store.iterdir() if p.name.startswith(("rollout-", "step-")))
    assert names == ["rollout-0", "rollout-1", "step-0-0", "step-1-0"], names
    ga = int(options.get("gradient_accumulation_steps", 1))
    for rollout_id in (0, 1):
        rollout, _ = open_for_replay(str(store), rollout=rollout_id)
        assert sorted(s.rank for s in rollout) == [0, 1]
        samples = {r.sample_id: r for s in rollout for r in s.index.samples}
        # a row is its position in the generation batch gathered over the processes (rank r holds 4r..4r+3), its
        # group that position // num_generations: each process generated one prompt's 4 completions
        for source in rollout:
            rows = [4 * source.rank + i for i in range(4)]
            assert [r.sample_id for r in source.index.samples] == [f"s-{rollout_id}-{i}" for i in rows]
            assert {r.group_index for r in source.index.samples} == {source.rank}
        tokens = sum(float(s.load_payload("loss_mask").sum()) for s in rollout)

        step = f"{rollout_id}:0"
        sources, _ = open_for_replay(str(store), step=step)
        assert sorted(s.rank for s in sources) == [0, 1]
        for source in sources:
            assert source.manifest.conventions is not None and source.manifest.conventions.profile == "trl"
            ids = source.index.identity.micro_batch_ids
            assert len(ids) == ga and all(i.startswith(f"mb-{source.rank}-") for i in ids), ids
            for record in source.index.samples:  # the step's rows found again after TRL's shuffle and split
                upstream = samples[record.sample_id]
                assert (record.group_index, record.raw_reward, record.reward) == (
                    upstream.group_index,
                    upstream.raw_reward,
                    upstream.reward,
                )
            config = source.index.config
            assert config.metrics_per_rank is False
            if options.get("loss_type", "dapo") == "dapo":
                # the generation batch's tokens over both processes / processes x GA / steps_per_generation (= GA)
                assert config.loss_denominator == pytest.approx(tokens / PROCESSES)
            else:
                assert config.loss_denominator == 4.0  # grpo: this process's rows of the step
            expected = source.expected["loss.policy"]
            assert expected.get("loss") is not None and expected.get("pg_clipfrac") is None

        chain = replay_chain(
            sources, lambda r: open_for_replay(str(store), rollout=r)[0], replay_step=lambda s: replay(s)
        )
        assert chain.linked and chain.link is not None and chain.link.status == "pass", chain.link
        for entry in (*chain.upstream, chain.step):
            assert entry.report is not None and entry.report.status == "pass", (entry.bundle, _failures(entry.report))
        assert [s.rank for s in chain.step.report.stages if s.stage == "loss.policy" and s.status == "pass"] == [0, 1]

    result = _cli("conventions", str(store), "--step", "0:0")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "profile trl" in result.stdout and "recorded config (profile trl): reproduces every stage" in result.stdout


if __name__ == "__main__":
    _process(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))
