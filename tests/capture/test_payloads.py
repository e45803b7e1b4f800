"""The hooks' `payloads=`: a payload the stage table declares for a bundle kind is taken by name, written, expected by
validate and handed to the kernel replay runs; a name the table does not declare is refused. A new payload is one
entry of the table plus the kernel that reads it: the end-to-end test adds one at test time."""

from __future__ import annotations

import importlib
import logging
import sys

import pytest
import torch

from tests.capture.helpers import IDS, TOKENS, microbatch_kwargs, rollout_kwargs
from trajectory_replay import capture
from trajectory_replay.bundle import open_native
from trajectory_replay.bundle.schema import RecomputeConfig, StageId
from trajectory_replay.bundle.stage_io import STAGE_IO
from trajectory_replay.capture.records import bundle_payloads
from trajectory_replay.replay import replay
from trajectory_replay.replay.losses import PolicyLossData, policy_loss_outputs
from trajectory_replay.replay.registry import resolve_kernels
from trajectory_replay.replay.validate import validate_sources

PLUGIN_MODULE = "acme_payload_kernels"
PLUGIN_CODE = '''
import torch

from trajectory_replay.replay import estimators
from trajectory_replay.replay.losses import PolicyLossTokens
from trajectory_replay.replay.registry import EstimatorKernel, PolicyLossKernel

SEEN = []
"""(kernel, the new payload's values) of every call: what replay handed the kernel."""


def bonus_advantages(inputs):
    """A_t = r' + the recorded per-token bonus."""
    bonus = inputs.payloads["token_bonus"]
    SEEN.append(("acme_bonus", bonus.tolist()))
    return estimators.AdvantageOutputs(torch.repeat_interleave(inputs.rewards, inputs.lengths) + bonus)


def gated_tokens(inputs):
    """The vanilla policy gradient, each token's term scaled by its recorded gate."""
    gate = inputs.payloads["token_gate"]
    SEEN.append(("acme_gated", gate.tolist()))
    ratio = torch.exp(inputs.log_probs - inputs.old_log_probs)
    return PolicyLossTokens(-inputs.advantages * ratio * gate, torch.zeros_like(ratio),
                            inputs.old_log_probs - inputs.log_probs)


ACME_BONUS = EstimatorKernel("acme_bonus", estimators.raw_rewards, bonus_advantages, grouped=False)
ACME_GATED = PolicyLossKernel("acme_gated", gated_tokens)
'''

N = len(IDS) * TOKENS
BONUS = [0.125 * i for i in range(N)]
GATE = [1.0, 1.0, 0.5, 0.5, 1.0, 0.25, 0.75, 1.0]


@pytest.fixture
def plugin(tmp_path_factory):
    """A distribution on sys.path (its dist-info and entry points, as pip lays them out) registering the kernels
    that read the new payloads; its module, for what they were handed."""
    site = tmp_path_factory.mktemp("site")
    (site / f"{PLUGIN_MODULE}.py").write_text(PLUGIN_CODE)
    info = site / "acme_payload_kernels-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-payload-kernels\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[trajectory_replay.kernels]\n"
        f"acme_bonus = {PLUGIN_MODULE}:ACME_BONUS\n"
        f"acme_gated = {PLUGIN_MODULE}:ACME_GATED\n"
    )
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    yield importlib.import_module(PLUGIN_MODULE)
    sys.path.remove(str(site))
    sys.modules.pop(PLUGIN_MODULE, None)
    importlib.invalidate_caches()


def _add_payload(monkeypatch, stage: StageId, name: str) -> None:
    """The one table entry: `name` among the payloads `stage` reads (restored after the test)."""
    io = STAGE_IO[stage]
    monkeypatch.setitem(STAGE_IO, stage, type(io)(**{**io.__dict__, "payloads": io.payloads + (name,)}))


def _first_divergence(url: str):
    """The first stage whose recomputation disagrees with the bundle (None: every stage passed)."""
    report = replay(open_native(url))
    assert all(s.status in ("pass", "fail") for s in report.stages), [
        (s.stage, s.status, s.message) for s in report.stages
    ]
    return report.first_divergent_stage


def _rollout(bonus: list[float]) -> dict:
    """capture_rollout arguments of the canonical samples under acme_bonus: advantages r + the true bonus, and
    `bonus` as the recorded payload."""
    config = RecomputeConfig(advantage_estimator="acme_bonus", n_samples_per_prompt=2, kl_coef=0.0)
    kwargs = rollout_kwargs(flat=True)
    raw = torch.tensor(kwargs["raw_rewards"]).repeat_interleave(TOKENS)
    return {
        **kwargs,
        "config": config,
        "rewards": kwargs["raw_rewards"],
        "kl": torch.zeros(N),
        "advantages": raw + torch.tensor(BONUS),
        "payloads": {"token_bonus": torch.tensor(bonus)},
    }


def test_a_payload_added_to_the_table_is_captured_validated_and_read_by_its_kernel(
    tmp_path, make_manager, monkeypatch, plugin
):
    _add_payload(monkeypatch, StageId.ADVANTAGE_ESTIMATE, "token_bonus")
    assert "token_bonus" in bundle_payloads("rollout")
    capture.set_manager(make_manager(tmp_path))
    assert capture.capture_rollout(1, **_rollout(BONUS))
    corrupted = list(BONUS)
    corrupted[5] += 1.0
    assert capture.capture_rollout(2, **_rollout(corrupted))
    assert capture.capture_rollout(3, **{**_rollout(BONUS), "payloads": None})
    assert capture.shutdown(30)

    url = str(tmp_path / "rollout-1")
    [source] = open_native(url)
    assert source.load_payload("token_bonus").tolist() == BONUS
    assert "token_bonus" in source.manifest.stage_contracts[StageId.ADVANTAGE_ESTIMATE].inputs
    assert validate_sources(url, open_native(url)).problems == []
    assert _first_divergence(url) is None
    assert ("acme_bonus", BONUS) in plugin.SEEN
    assert _first_divergence(str(tmp_path / "rollout-2")) == StageId.ADVANTAGE_ESTIMATE
    # validate expects it: a bundle without it is reported
    url = str(tmp_path / "rollout-3")
    assert validate_sources(url, open_native(url)).problems == [
        "rollout-3: stage advantage.estimate needs payload 'token_bonus', which is missing"
    ]


def test_a_step_payload_added_to_the_table_reaches_the_policy_loss_kernel(tmp_path, make_manager, monkeypatch, plugin):
    _add_payload(monkeypatch, StageId.LOSS_POLICY, "token_gate")
    config = RecomputeConfig(advantage_estimator="grpo", n_samples_per_prompt=2, policy_loss="acme_gated")
    halves = [[0, 1], [2, 3]]
    first = microbatch_kwargs(range(4))
    data = PolicyLossData(
        first["log_probs"],
        first["old_log_probs"],
        first["advantages"],
        first["entropy"],
        torch.ones(N),
        torch.full((4,), TOKENS),
        payloads={"token_gate": torch.tensor(GATE)},
    )
    scalars = policy_loss_outputs(data, config, resolve_kernels(config))
    capture.set_manager(make_manager(tmp_path))
    for step, gate in ((0, GATE), (1, [1.0] * N)):
        for j, pos in enumerate(halves):
            rows = slice(j * len(pos) * TOKENS, (j + 1) * len(pos) * TOKENS)
            assert capture.capture_microbatch(
                1, step, f"mb-{j}", **microbatch_kwargs(pos), payloads={"token_gate": torch.tensor(gate[rows])}
            )
        assert capture.capture_step_end(1, step, config=config, **scalars)
    assert capture.shutdown(30)

    url = str(tmp_path / "step-1-0")
    [source] = open_native(url)
    assert source.load_payload("token_gate").tolist() == GATE
    assert validate_sources(url, open_native(url)).problems == []
    assert _first_divergence(url) is None
    assert ("acme_gated", GATE) in plugin.SEEN
    assert _first_divergence(str(tmp_path / "step-1-1")) == StageId.LOSS_POLICY


@pytest.mark.parametrize(
    "payloads,why",
    [
        ({"token_bonus": torch.zeros(N)}, "'token_bonus' is not a payload of a rollout-level bundle"),
        ({"vpreds": torch.zeros(N)}, "'vpreds' is not a payload of a rollout-level bundle"),  # a step-level one
        ({"loss_mask": torch.ones(N)}, "'loss_mask' is not a payload of a rollout-level bundle"),
        ({"kl": torch.zeros(N)}, "'kl' is given both as an argument and in payloads"),
    ],
    ids=["undeclared", "other-kind", "loss-mask", "twice"],
)
def test_a_payload_the_table_does_not_declare_is_a_counted_hook_error(tmp_path, make_manager, caplog, payloads, why):
    manager = make_manager(tmp_path)
    capture.set_manager(manager)
    with caplog.at_level(logging.ERROR, logger="trajectory_replay.capture"):
        assert capture.capture_rollout(1, **{**rollout_kwargs(flat=True), "payloads": payloads}) is False
    assert capture.shutdown(30)
    [line] = [r.getMessage() for r in caplog.records]
    assert "capture_rollout(1)" in line and why in line, line
    assert manager.stats()["errors"] == 1 and manager.stats()["written"] == 0
    assert not (tmp_path / "rollout-1").exists()


def test_a_step_payload_not_in_the_table_is_refused_by_the_micro_batch_hook(tmp_path, make_manager, caplog):
    manager = make_manager(tmp_path)
    capture.set_manager(manager)
    with caplog.at_level(logging.ERROR, logger="trajectory_replay.capture"):
        assert (
            capture.capture_microbatch(
                1, 0, "mb-0", **microbatch_kwargs(range(4)), payloads={"token_gate": torch.ones(N)}
            )
            is False
        )
    [line] = [r.getMessage() for r in caplog.records]
    assert "capture_microbatch(1, 0, 'mb-0')" in line and "'token_gate' is not a payload of a step-level" in line
    assert manager.stats()["errors"] == 1


def test_declared_payloads_by_name_are_written_like_the_named_arguments(tmp_path, make_manager):
    kwargs = rollout_kwargs(flat=True)
    by_name = {name: kwargs.pop(name) for name in ("old_log_probs", "ref_log_probs", "kl", "advantages")}
    capture.set_manager(make_manager(tmp_path))
    assert capture.capture_rollout(
        1,
        **kwargs,
        old_log_probs=None,
        ref_log_probs=None,
        kl=None,
        advantages=None,
        payloads={**by_name, "values": torch.full((N,), 0.5)},
    )
    assert capture.shutdown(30)
    [source] = open_native(str(tmp_path / "rollout-1"))
    assert set(source.manifest.payloads) == {
        "old_log_probs",
        "ref_log_probs",
        "kl",
        "advantages",
        "values",
        "loss_mask",
    }
    assert source.load_payload("values").tolist() == [0.5] * N
    assert replay([source]).passed
