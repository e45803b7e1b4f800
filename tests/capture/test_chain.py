"""`replay <capture-dir> --step R:S`: the step-level bundle replayed with the rollout-level bundle that produced its
samples, the link between them, and one first divergence in chain order; bundles written by capture, the CLI
run in-process as a user runs it."""

from __future__ import annotations

import json
import math

import torch
from typer.testing import CliRunner

from tests.capture.helpers import (
    CONFIG,
    CURRENT,
    ENTROPY,
    ENTROPY_COEF,
    EPS,
    OLD,
    REWARDS,
    TOKENS,
    microbatch_kwargs,
    rollout_kwargs,
)
from trajectory_replay.bundle import open_native
from trajectory_replay.cli import app

runner = CliRunner()
WRITER = "thread"


def _scalars(advantages: list[float]) -> dict[str, float]:
    """The V1 loss scalars of samples whose every token has the given advantage (one per sample)."""
    ratio = math.exp(CURRENT - OLD)
    clipped = min(max(ratio, 1 - EPS), 1 + EPS)
    pg = sum(max(-ratio * a, -clipped * a) for a in advantages)
    clipfrac = sum(1.0 if -clipped * a > -ratio * a else 0.0 for a in advantages)
    ent = ENTROPY * len(advantages)
    return {
        "loss": pg - ENTROPY_COEF * ent,
        "pg_loss": pg,
        "entropy_loss": ent,
        "pg_clipfrac": clipfrac,
        "ppo_kl": (OLD - CURRENT) * len(advantages),
    }


def _capture(
    manager, *, rollout: bool = True, rewards: list[float] = REWARDS, step_advantages: list[float] | None = None
) -> None:
    """rollout-3 (recording `rewards` as post-processed, and advantages from them) and step-3-0 (two micro-batches,
    consuming `step_advantages`, by default the rollout's)."""
    if rollout:
        kwargs = {
            **rollout_kwargs(),
            "rewards": list(rewards),
            "advantages": [torch.full((TOKENS,), r) for r in rewards],
        }
        assert manager.capture_rollout(3, **kwargs)
    consumed = list(rewards) if step_advantages is None else step_advantages
    for j, pos in enumerate(([0, 1], [2, 3])):
        kwargs = microbatch_kwargs(pos)
        kwargs["rewards"] = [rewards[i] for i in pos]
        kwargs["advantages"] = torch.tensor([consumed[i] for i in pos for _ in range(TOKENS)])
        assert manager.capture_microbatch(3, 0, f"mb-{j:04d}", **kwargs)
    assert manager.capture_step_end(3, 0, config=CONFIG, **_scalars(consumed))
    assert manager.flush(30)


def _replay(root, *extra: str):
    result = runner.invoke(app, ["replay", str(root), "--step", "3:0", *extra])
    return result, (json.loads(result.stdout) if "--json" in extra else None)


def test_step_records_the_rollout_that_produced_each_sample(tmp_path, make_manager):
    _capture(make_manager(tmp_path, writer=WRITER))
    (step,) = open_native(str(tmp_path / "step-3-0"))
    assert [r.rollout_id for r in step.index.samples] == [3, 3, 3, 3]
    (rollout,) = open_native(str(tmp_path / "rollout-3"))
    assert all(r.rollout_id is None for r in rollout.index.samples)


def test_a_clean_capture_passes_end_to_end(tmp_path, make_manager):
    _capture(make_manager(tmp_path, writer=WRITER))
    result, report = _replay(tmp_path, "--json")
    assert result.exit_code == 0, result.stdout
    assert report["passed"] is True and report["first_divergence"] is None
    assert [(e["bundle"], e["role"]) for e in report["chain"]] == [("rollout-3", "upstream"), ("step-3-0", "step")]
    assert report["link"]["status"] == "pass" and "4 samples linked" in report["link"]["message"]
    assert "advantages: 8 values match" in report["link"]["message"]
    text, _ = _replay(tmp_path)
    assert text.exit_code == 0 and "chain rollout-3 -> step-3-0 — first divergence: none" in text.stdout
    assert "== link: rollout outputs -> step-3-0 inputs" in text.stdout


def test_an_upstream_fault_is_named_in_the_rollout_bundle_not_at_the_loss(tmp_path, make_manager):
    """Rewards normalized wrongly before capture: the step's loss is consistent with what it was given, so only
    the chain can say where the error starts."""
    wrong = [1.0, -1.0, -1.0, 1.0]
    _capture(make_manager(tmp_path, writer=WRITER), rewards=wrong)
    alone = runner.invoke(app, ["replay", str(tmp_path), "--step", "3:0", "--no-upstream", "--json"])
    assert alone.exit_code == 0 and "chain" not in json.loads(alone.stdout)
    result, report = _replay(tmp_path, "--json")
    assert result.exit_code == 1
    first = report["first_divergence"]
    assert (first["bundle"], first["stage"], first["field"]) == ("rollout-3", "reward.post_process", "reward")
    assert first["sample"] == "s-0"
    assert report["link"]["status"] == "fail"  # the step took advantages the rollout bundle does not recompute
    assert report["stages"][-1]["status"] == "pass"  # the step's own loss is consistent


def test_advantages_altered_after_capture_are_named_at_the_link(tmp_path, make_manager):
    altered = list(REWARDS)
    altered[2] = 0.5
    _capture(make_manager(tmp_path, writer=WRITER), step_advantages=altered)
    result, report = _replay(tmp_path, "--json")
    assert result.exit_code == 1
    assert report["chain"][0]["report"]["passed"] is True and report["stages"][-1]["status"] == "pass"
    assert report["first_divergence"] == {
        "bundle": "step-3-0",
        "stage": "link",
        "rank": None,
        "sample": "s-2",
        "field": "advantages",
        "token": 0,
    }


def test_missing_rollout_bundles_leave_the_step_alone(tmp_path, make_manager):
    _capture(make_manager(tmp_path, writer=WRITER), rollout=False)
    result, report = _replay(tmp_path, "--json")
    assert result.exit_code == 0, result.stdout
    assert report["chain"][0] == {
        "bundle": "rollout-3",
        "role": "upstream",
        "report": None,
        "note": "not in the store: the step is replayed alone",
    }
    assert report["link"] is None and report["passed"] is True
    text, _ = _replay(tmp_path)
    assert "== rollout-3 (upstream): not in the store: the step is replayed alone" in text.stdout


def test_a_step_bundle_from_before_samples_named_their_rollout_replays_alone_with_a_note(tmp_path, make_manager):
    from trajectory_replay.bundle import BundleWriter

    _capture(make_manager(tmp_path / "new", writer=WRITER))
    (step,) = open_native(str(tmp_path / "new" / "step-3-0"))
    masks = step.load_payload("loss_mask").tolist()  # the writer takes loss masks from the records
    index = step.index.model_copy(
        update={
            "samples": [
                r.model_copy(update={"rollout_id": None, "loss_mask": masks[i * TOKENS : (i + 1) * TOKENS]})
                for i, r in enumerate(step.index.samples)
            ]
        }
    )
    old = tmp_path / "old"
    writer = BundleWriter(
        str(old / "step-3-0"), step.manifest.model_copy(update={"payloads": {}}), index, step.expected
    )
    for name in step.manifest.payloads:
        if name != "loss_mask":
            writer.write_payload(name, step.load_payload(name))
    writer.finalize()
    result, report = _replay(old, "--json")
    assert result.exit_code == 0, result.stdout
    assert report["chain"] == [report["chain"][-1]] and report["notes"][0].startswith(
        "step bundle step-3-0 records no rollout bundle for its samples"
    )
    text, _ = _replay(old)
    assert text.stdout.startswith("note: step bundle step-3-0 records no rollout bundle")


def test_the_html_report_of_a_chain_shows_upstream_link_and_step(tmp_path, make_manager):
    _capture(make_manager(tmp_path / "cap", writer=WRITER), rewards=[1.0, -1.0, -1.0, 1.0])
    page = tmp_path / "chain.html"
    result, _ = _replay(tmp_path / "cap", "--html", str(page))
    assert result.exit_code == 1
    text = page.read_text(encoding="utf-8")
    assert "first divergence: bundle rollout-3, stage reward.post_process" in text
    assert "rollout-3 (upstream)" in text and "link: rollout outputs → step inputs" in text
    assert "step-3-0 (step)" in text and "link: advantages, largest error per sample" in text


def _shape(doc: dict) -> dict:
    """The keys of a replay report and of its stage entries, with the type of each value (null as any type)."""

    def kinds(d: dict) -> dict:
        return {k: None if v is None else type(v).__name__ for k, v in d.items()}

    return {
        "top": set(doc),
        "stage": {k for s in doc["stages"] for k in s},
        "types": {k: t for k, t in kinds(doc).items() if t is not None},
    }


def test_a_chained_report_names_an_upstream_divergence_in_the_keys_of_a_single_report(tmp_path, make_manager):
    """A client reading a single bundle's keys (status, passed, first_divergent_stage, stages) gets the upstream
    divergence from a chain too, and both objects share one schema (the chain adds chain, link and notes)."""
    _capture(make_manager(tmp_path, writer=WRITER), rewards=[1.0, -1.0, -1.0, 1.0])
    result, chained = _replay(tmp_path, "--json")
    assert result.exit_code == 1 and chained["status"] == "diverged" and chained["passed"] is False
    assert chained["first_divergent_stage"] == "reward.post_process"
    assert chained["first_divergence"]["bundle"] == "rollout-3" and chained["bundle_id"] == "step-3-0"
    failed = [(s["bundle"], s["stage"]) for s in chained["stages"] if s["status"] == "fail"]
    assert failed[0] == ("rollout-3", "reward.post_process") and ("step-3-0", "link") in failed
    single = json.loads(runner.invoke(app, ["replay", str(tmp_path / "rollout-3"), "--json"]).stdout)
    assert single["first_divergence"] == chained["first_divergence"]
    one, chain = _shape(single), _shape(chained)
    assert chain["top"] - one["top"] == {"chain", "link", "notes"} and one["top"] <= chain["top"]
    assert one["stage"] == chain["stage"]
    assert {k: t for k, t in chain["types"].items() if k in one["types"]} == one["types"]
    text = _replay(tmp_path)[0].stdout
    assert text.startswith(
        "chain rollout-3 -> step-3-0 — first divergence: bundle rollout-3, stage reward.post_process"
    )
