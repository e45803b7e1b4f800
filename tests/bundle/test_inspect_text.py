"""`inspect`'s human report, line for line, for an inspection that has every section (a multi-rank bundle not yet
finalized, with a recorded profile, redaction, a damaged payload and another shard's damage)."""

from __future__ import annotations

from trajectory_replay.bundle.inspect import Inspection


def every_section() -> Inspection:
    return Inspection(
        target="/store/step-3-1",
        state="finalizable",
        bundle_id="step-3-1",
        detail="COMPLETE is missing",
        anchor="actor step 3:1",
        identity={"weight_lineage": {"rollout_weight": 7, "actor_weight": None}, "rank": {"dp": 0, "tp": 1}},
        producer={"framework": "verl", "version": "", "host": None, "pid": 42},
        ranks=[0, 1],
        expected_ranks=[0, 1, 2],
        stages={"reward.post_process": "compared", "loss.policy": "recorded only"},
        config={"advantage_estimator": "grpo", "kl_coef": 0.05, "std_eps": 1e-6, "loss_agg_mode": "token_mean"},
        conventions={"profile": "verl", "framework": "verl", "framework_version": "0.8.0.dev (b178a3cd)"},
        samples=8,
        tokens=120,
        rank_samples={"0": 4, "1": 4},
        payloads=[
            {
                "name": "old_log_probs",
                "role": "input",
                "dtype": "torch.float32",
                "shape": [120],
                "size": 480,
                "chunks": 1,
            },
            {
                "name": "a_payload_name_longer_than_its_column",
                "role": "output",
                "dtype": "torch.float64",
                "shape": [8, 15],
                "size": 3 << 20,
                "chunks": None,
                "error": "record objects/ab is missing",
                "ref_error": "blob ref blobs/cd is missing",
            },
        ],
        logical_bytes=(3 << 20) + 480,
        unique_chunk_bytes=400,
        unreadable_bytes=3 << 20,
        redaction={"prompt": "drop", "weird": "hash"},
        problems=[
            "payload 'a_payload_name_longer_than_its_column': record objects/ab is missing",
            "rank 2 payload 'kl': blob ref blobs/ef is corrupt (not a digest)",
        ],
    )


def test_every_section_piped_keeps_whole_lines(capsys):
    # stdout captured: not a terminal, so no width
    assert every_section().render_text().split("\n") == [
        "bundle step-3-1 [native] — finalizable: COMPLETE is missing; DAMAGED (2 problems)",
        "  anchor     actor step 3:1",
        "  ranks      0, 1, 2 (0, 1 landed)",
        "  producer   framework=verl, pid=42",
        "  lineage    rollout_weight=7 actor_weight=unset; topology dp=0 tp=1",
        "  config     advantage_estimator=grpo, kl_coef=0.05, loss_agg_mode=token_mean",
        "  conventions profile verl (verl 0.8.0.dev (b178a3cd))",
        "  samples    8 (120 response tokens; rank 0: 4, rank 1: 4)",
        "  stage      reward.post_process    compared",
        "  stage      loss.policy            recorded only",
        "  redaction  prompt=drop, weird=hash (not a redactable field: was not applied)",
        "  payload    old_log_probs    input    torch.float32  [120]        480 B, 1 chunks",
        "  payload    a_payload_name_longer_than_its_column output   torch.float64  [8, 15]      3.0 MiB  "
        "UNREADABLE: record objects/ab is missing  DAMAGED: blob ref blobs/cd is missing",
        "  total      3.0 MiB of payloads (rank 0) (3.0 MiB unreadable), 400 B in unique chunks "
        "(dedup 1.20x of the 480 B readable)",
        "  damage     rank 2 payload 'kl': blob ref blobs/ef is corrupt (not a digest)",
        "  damage     run `trajectory-replay fsck` on the store root: it re-links a missing blob ref; "
        "--repair-from URL re-fetches missing or corrupt objects from a copy",
    ]


def test_every_section_in_60_columns_wraps_under_the_values_and_clips_long_names():
    assert every_section().render_text(60).split("\n") == [
        "bundle step-3-1 [native] — finalizable: COMPLETE is missing;",
        "             DAMAGED (2 problems)",
        "  anchor     actor step 3:1",
        "  ranks      0, 1, 2 (0, 1 landed)",
        "  producer   framework=verl, pid=42",
        "  lineage    rollout_weight=7 actor_weight=unset; topology",
        "             dp=0 tp=1",
        "  config     advantage_estimator=grpo, kl_coef=0.05,",
        "             loss_agg_mode=token_mean",
        "  conventions profile verl (verl 0.8.0.dev (b178a3cd))",
        "  samples    8 (120 response tokens; rank 0: 4, rank 1: 4)",
        "  stage      reward.post_process    compared",
        "  stage      loss.policy            recorded only",
        "  redaction  prompt=drop, weird=hash (not a redactable",
        "             field: was not applied)",
        "  payload    old_log_probs    input    torch.float32  [120]",
        "             480 B, 1 chunks",
        "  payload    a_payload_name_… output   torch.float64  [8,",
        "             15]      3.0 MiB  UNREADABLE: record objects/ab",
        "             is missing  DAMAGED: blob ref blobs/cd is",
        "             missing",
        "  total      3.0 MiB of payloads (rank 0) (3.0 MiB",
        "             unreadable), 400 B in unique chunks (dedup",
        "             1.20x of the 480 B readable)",
        "  damage     rank 2 payload 'kl': blob ref blobs/ef is",
        "             corrupt (not a digest)",
        "  damage     run `trajectory-replay fsck` on the store root:",
        "             it re-links a missing blob ref; --repair-from",
        "             URL re-fetches missing or corrupt objects from",
        "             a copy",
    ]


def test_a_bundle_with_nothing_recorded_is_its_title_alone():
    assert (
        Inspection(target="/store/x", state="incomplete", detail="rank 1 has not landed").render_text(80)
        == "bundle /store/x [native] — incomplete: rank 1 has not landed"
    )
