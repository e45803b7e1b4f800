"""CUDA smoke test: capture CUDA tensors through the hooks without a device sync, replay on the CPU."""

from __future__ import annotations

import pytest
import torch

from tests.capture.helpers import CONFIG, REWARDS, loss_scalars, microbatch_kwargs, rollout_kwargs
from trajectory_replay import capture
from trajectory_replay.bundle import open_native
from trajectory_replay.capture.config import ENV_CAPTURE, ENV_DIR
from trajectory_replay.replay import replay

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (torch.cuda.is_available() False)"),
]


def test_cuda_capture_replays_on_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_CAPTURE, "1")
    monkeypatch.setenv(ENV_DIR, str(tmp_path))
    manager = capture.maybe_enable_for_actor(0, True, [0], atexit_timeout=None)
    rollout = rollout_kwargs(device="cuda")  # lists of per-sample CUDA tensors
    flat = rollout_kwargs(device="cuda", flat=True)
    mbs = [microbatch_kwargs([0, 1], device="cuda"), microbatch_kwargs([2, 3], device="cuda")]
    scalars = {k: torch.tensor(v, device="cuda") for k, v in loss_scalars(range(4)).items()}
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronizing call in a hook raises...
    try:
        assert capture.capture_rollout(1, **rollout)
        assert capture.capture_rollout(2, **flat)
        for j, mb in enumerate(mbs):
            assert capture.capture_microbatch(1, 0, f"mb-{j:04d}", **mb)
        assert capture.capture_step_end(1, 0, config=CONFIG, **scalars)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert manager.stats()["errors"] == 0  # ...and would have been counted here
    # training reuses its device buffers at once: the bundles keep the captured values
    for t in rollout["advantages"]:
        t.fill_(99.0)
    flat["advantages"].fill_(99.0)
    for mb in mbs:
        mb["log_probs"].fill_(-7.0)
    scalars["loss"].fill_(42.0)
    assert capture.get_manager().flush(60)
    stats = capture.stats()
    assert stats["written"] == 3 and stats["errors"] == 0, stats
    for name in ("rollout-1", "rollout-2", "step-1-0"):
        sources = open_native(str(tmp_path / name))
        report = replay(sources)
        assert report.passed, [(s.stage, s.status, s.message) for s in report.stages]
    [r1] = open_native(str(tmp_path / "rollout-1"))
    assert r1.load_payload("advantages").tolist() == [r for r in REWARDS for _ in range(2)]
    [step] = open_native(str(tmp_path / "step-1-0"))
    assert step.load_payload("log_probs").tolist() == [0.5] * 8
    assert step.expected["loss.policy"]["loss"] == pytest.approx(loss_scalars(range(4))["loss"], rel=1e-6)
    assert capture.shutdown(timeout=10)
