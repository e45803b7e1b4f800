"""The reward and advantage side of a verl 0.9 step, computed by verl itself and replayed under the verl profile.

A batch of 16 prompts x 4 samples (8-48 response tokens, right-padded with junk log-probs, some samples multi-turn
with observation spans of mask 0, one ending on an observation) goes through verl's own `apply_kl_penalty` (the KL
in the reward) and `compute_advantage`; the outputs are laid out as a bundle (valid tokens only, uid -> group, the
KL as verl forms it, kld * response_mask) and replayed. Every configuration replays clean at default tolerances,
and the config field that expresses verl's behaviour is shown to matter: the other choice diverges at its stage.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from verl import DataProto
from verl.trainer.config import AlgoConfig
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.ray_trainer import apply_kl_penalty, compute_advantage

from tests.replay.conftest import source_of
from trajectory_replay.bundle.schema import (
    BundleIndex,
    Identity,
    Manifest,
    RecomputeConfig,
    SampleRecord,
    StageContract,
    StageId,
)
from trajectory_replay.replay import kernels, replay
from trajectory_replay.replay.fixtures import CanonicalCase

PROMPTS, SAMPLES, WIDTH = 16, 4, 48
BETA = 0.05
STAGES = (
    StageId.SAMPLE,
    StageId.REWARD_RAW,
    StageId.REWARD_POST_PROCESS,
    StageId.ADVANTAGE_KL,
    StageId.ADVANTAGE_ESTIMATE,
)


def _batch(seed: int) -> DataProto:
    """A verl batch after rollout, scoring and the log-prob passes: right-padded responses, junk in the padding,
    observation spans (mask 0) inside a third of the responses, uids of interleaved group members."""
    g = torch.Generator().manual_seed(seed)
    n = PROMPTS * SAMPLES
    lengths = torch.randint(8, WIDTH + 1, (n,), generator=g)
    positions = torch.arange(WIDTH)
    attention = (positions[None, :] < lengths[:, None]).to(torch.int64)
    response_mask = attention.clone()
    for i in range(0, n, 3):  # a tool call's output, inside the response
        start = int(torch.randint(2, int(lengths[i]) - 3, (1,), generator=g))
        response_mask[i, start : start + int(torch.randint(1, 4, (1,), generator=g))] = 0
    response_mask[5, int(lengths[5]) - 2 :] = 0  # the response ends on an observation
    old = -torch.rand(n, WIDTH, generator=g) * 3
    ref = old + torch.randn(n, WIDTH, generator=g) * 0.3
    ref[7, 1], ref[9, 2] = old[7, 1] + 25.0, old[9, 2] - 30.0  # log ratios beyond verl's clamp at 20
    junk = torch.full((n, WIDTH), 123.0)
    old, ref = torch.where(attention.bool(), old, junk), torch.where(attention.bool(), ref, -junk)
    ref = torch.where(response_mask.bool() | ~attention.bool(), ref, ref + 40.0)  # observation tokens: anything
    scores = torch.zeros(n, WIDTH)
    outcome = (torch.rand(n, generator=g) > 0.5).float() + torch.rand(n, generator=g) * 0.5
    scores[torch.arange(n), lengths - 1] = outcome
    uid = np.array([f"prompt-{(i * 7) % PROMPTS}" for i in range(n)], dtype=object)  # members interleaved
    return DataProto.from_dict(
        tensors={
            "responses": torch.zeros(n, WIDTH, dtype=torch.int64),
            "attention_mask": attention,
            "response_mask": response_mask,
            "token_level_scores": scores,
            "old_log_probs": old,
            "ref_log_prob": ref,
        },
        non_tensors={"uid": uid},
    )


def _verl_step(estimator: str, kl_penalty: str, seed: int, gamma: float = 1.0, norm: bool = True) -> DataProto:
    """The batch after verl's reward KL and advantages."""
    data, _ = apply_kl_penalty(_batch(seed), core_algos.FixedKLController(BETA), kl_penalty=kl_penalty)
    algo = AlgoConfig(gamma=gamma, adv_estimator=estimator, norm_adv_by_std_in_grpo=norm, use_kl_in_reward=True)
    return compute_advantage(
        data, estimator, gamma=gamma, num_repeat=SAMPLES, norm_adv_by_std_in_grpo=norm, config=algo
    )


def _post_processed(data: DataProto, estimator: str) -> list[float]:
    """r' per sample: what the estimator broadcast (grouped outcome estimators), the score less its group's mean
    (the baseline variant: verl whitens it before it shows), or the score itself (REINFORCE++)."""
    mask = data.batch["response_mask"].bool()
    first = mask.float().argmax(dim=1)
    if estimator in ("grpo", "rloo"):
        return data.batch["advantages"][torch.arange(len(first)), first].tolist()
    score = data.batch["token_level_rewards"].sum(dim=-1)
    if estimator == "reinforce_plus_plus":
        return data.batch["token_level_scores"].sum(dim=-1).tolist()
    uid = data.non_tensor_batch["uid"]
    means = {u: score[uid == u].mean() for u in set(uid)}
    return [float(s - means[u]) for s, u in zip(score, uid)]


def _case(data: DataProto, estimator: str, config: RecomputeConfig) -> CanonicalCase:
    """verl's outputs as a rollout-level bundle: valid response tokens only, uid -> group."""
    b = data.batch
    lengths = b["attention_mask"].sum(dim=1).tolist()

    def flat(name: str) -> torch.Tensor:
        return torch.cat([row[:n] for row, n in zip(b[name], lengths)])

    kld = core_algos.kl_penalty(b["old_log_probs"], b["ref_log_prob"], config_kl(config)) * b["response_mask"]
    groups = {u: k for k, u in enumerate(dict.fromkeys(data.non_tensor_batch["uid"]))}
    raw = b["token_level_scores"].sum(dim=-1).tolist()
    post = _post_processed(data, estimator)
    records = [
        SampleRecord(
            sample_id=f"v-{i}",
            group_index=groups[u],
            response_length=n,
            total_length=n + 16,
            loss_mask=b["response_mask"][i, :n].tolist(),
            raw_reward=raw[i],
            reward=post[i],
        )
        for i, (n, u) in enumerate(zip(lengths, data.non_tensor_batch["uid"]))
    ]
    index = BundleIndex(bundle_id="b-verl", identity=Identity(rollout_id=1), samples=records, config=config)
    manifest = Manifest(bundle_id="b-verl", stage_contracts={s: StageContract(stage=s) for s in STAGES})
    expected = {"reward.raw": {"raw_rewards": raw}, "reward.post_process": {"rewards": post}}
    payloads = {
        "old_log_probs": flat("old_log_probs"),
        "ref_log_probs": flat("ref_log_prob"),
        "kl": torch.cat([row[:n] for row, n in zip(kld, lengths)]),
        "advantages": flat("advantages"),
    }
    return CanonicalCase(manifest, index, expected, payloads)


_TYPES = {"kl": "k1", "mse": "k2", "abs": "abs", "k3": "k3", "low_var_kl": "low_var_kl"}


def config_kl(config: RecomputeConfig) -> str:
    """verl's name of the config's reward-side KL estimator."""
    return {ours: theirs for theirs, ours in _TYPES.items()}[config.kl_loss_type]


def _config(estimator: str, kl_penalty: str, **options: object) -> RecomputeConfig:
    return RecomputeConfig.from_profile(
        "verl",
        adv_estimator=estimator,
        kl_penalty=kl_penalty,
        use_kl_in_reward=True,
        kl_coef=BETA,
        n_samples_per_prompt=SAMPLES,
        **options,
    )


CONFIGS = [
    pytest.param("grpo", "low_var_kl", {}, id="grpo-low_var_kl"),
    pytest.param("grpo", "kl", {"norm_adv_by_std_in_grpo": False}, id="grpo-unnormalized-k1"),
    pytest.param("rloo", "k3", {}, id="rloo-k3"),
    pytest.param("reinforce_plus_plus_baseline", "mse", {}, id="rf++-baseline-k2"),
    pytest.param("reinforce_plus_plus", "kl", {"gamma": 0.9}, id="rf++-multi-turn-k1"),
    pytest.param("reinforce_plus_plus", "low_var_kl", {}, id="rf++-multi-turn-low_var_kl"),
]


def _replayed(estimator: str, kl_penalty: str, options: dict, seed: int = 3):
    verl_options = {"norm": options.get("norm_adv_by_std_in_grpo", True), "gamma": options.get("gamma", 1.0)}
    data = _verl_step(estimator, kl_penalty, seed, **verl_options)
    case = _case(data, estimator, _config(estimator, kl_penalty, **options))
    return case, source_of(case)


@pytest.mark.parametrize("estimator, kl_penalty, options", CONFIGS)
def test_verls_reward_kl_and_advantages_replay_clean(estimator, kl_penalty, options):
    _, source = _replayed(estimator, kl_penalty, options)
    report = replay([source])
    assert report.passed, report.render_text()
    assert [s.stage for s in report.stages] == [s.value for s in STAGES]


@pytest.mark.parametrize(
    "estimator, kl_penalty, options, override, stage",
    [
        ("grpo", "low_var_kl", {}, {"kl_in_score": False}, "reward.post_process"),
        ("rloo", "k3", {}, {"kl_coef": BETA * 1.1}, "reward.post_process"),
        ("reinforce_plus_plus", "kl", {"gamma": 0.9}, {"masked_return": "restart"}, "advantage.estimate"),
        ("reinforce_plus_plus", "kl", {"gamma": 0.9}, {"kl_clamped": None}, "advantage.kl"),
    ],
    ids=["kl-not-in-score", "unrecorded-kl-coefficient", "return-restarted", "k1-clamped"],
)
def test_the_other_choice_diverges_where_it_differs(estimator, kl_penalty, options, override, stage):
    _, source = _replayed(estimator, kl_penalty, options)
    report = replay([source], overrides=override)
    assert report.first_divergent_stage == stage, report.render_text()


def test_verls_kl_of_a_masked_out_token_is_not_compared():
    """verl forms only kld * response_mask: on observation tokens the recorded KL is 0 while the log-probs give
    another value, which is no divergence."""
    case, source = _replayed("grpo", "low_var_kl", {})
    mask = source.payloads["loss_mask"].bool()
    ours = kernels.kl_estimate(
        case.payloads["old_log_probs"], case.payloads["ref_log_probs"], "low_var_kl", 20.0, 10.0, ("low_var_kl",)
    )
    assert (ours[~mask] != case.payloads["kl"][~mask]).any()
    assert replay([source]).stage("advantage.kl").status == "pass"


@pytest.mark.parametrize("kl_penalty", list(_TYPES))
def test_kl_estimates_match_verls_kl_penalty_with_the_verl_profiles_clamps(kl_penalty):
    """Every estimator over log ratios from -40 to 40: verl clamps only k3 and low_var_kl."""
    config = _config("grpo", kl_penalty)
    log_probs = torch.linspace(-40.0, 0.0, 801)
    ref = torch.flip(log_probs, (0,))
    theirs = core_algos.kl_penalty(log_probs, ref, kl_penalty)
    ours = kernels.kl_estimate(
        log_probs,
        ref,
        config.kl_loss_type,
        config.kl_log_ratio_clamp,
        config.kl_output_clamp,
        config.kl_clamped,
    )
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
