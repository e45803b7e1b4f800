"""`validate` of a native bundle decodes its payloads without torch, and finds what it finds with torch.

The torch-free runs are real processes in which `import torch` fails before any of the package loads.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from trajectory_replay.bundle import BundleWriter, open_native
from trajectory_replay.replay.fixtures import canonical_case
from trajectory_replay.replay.validate import validate_sources
from trajectory_replay.store import ObjectStore
from trajectory_replay.store.digest import object_key

REPO = Path(__file__).resolve().parents[2]

CHILD = """
import json, sys
sys.modules["torch"] = None
from trajectory_replay.cli import main
sys.argv = ["trajectory-replay", "validate", sys.argv[1], "--json"]
try:
    main()
except SystemExit as exc:
    code = exc.code or 0
print(json.dumps({"code": code, "torch": sys.modules.get("torch") is not None}))
"""


def _validate_without_torch(url: str) -> tuple[dict, dict]:
    """(the --json report, the exit code and whether torch got loaded) of `validate` in a torch-free process."""
    done = subprocess.run([sys.executable, "-c", CHILD, url], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    report, outcome = [json.loads(line) for line in done.stdout.strip().splitlines()]
    return report, outcome


def _bundle_with_non_finite_values(root: Path) -> str:
    """The canonical bundle, with a NaN in a float32 payload and an infinity in a bfloat16 one."""
    case = canonical_case(buggy=False)
    url = f"{root}/{case.manifest.bundle_id}"
    payloads = dict(case.payloads)
    entropy = payloads["entropy"].clone()
    entropy[5] = float("nan")  # s-2 token 1 (two tokens per sample)
    payloads["entropy"] = entropy
    ref = payloads["ref_log_probs"].to(torch.bfloat16)
    ref[2] = float("-inf")  # s-1 token 0
    payloads["ref_log_probs"] = ref
    writer = BundleWriter(url, case.manifest, case.index, case.expected)
    for name, tensor in payloads.items():
        writer.write_payload(name, tensor)
    writer.finalize()
    return url


class _TensorsOnly:
    """A native reader seen only through the replay protocol (as the older format is): tensors, no arrays."""

    def __init__(self, reader) -> None:
        self._reader = reader
        self.bundle_id, self.manifest, self.index = reader.bundle_id, reader.manifest, reader.index
        self.expected, self.rank = reader.expected, reader.rank

    def has_payload(self, name):
        return self._reader.has_payload(name)

    def load_payload(self, name, samples=None):
        return self._reader.load_payload(name, samples)


def test_validate_of_a_native_bundle_runs_without_torch_and_locates_non_finite_values(tmp_path):
    url = _bundle_with_non_finite_values(tmp_path)
    report, outcome = _validate_without_torch(url)
    assert outcome == {"code": 0, "torch": False}
    assert report["status"] == "pass" and report["problems"] == []
    assert report["payloads_checked"] == 7  # the six of the canonical case and the loss mask
    assert report["warnings"] == [
        "b-00001: payload 'entropy' has 1 non-finite value(s); first nan at s-2 token 1",
        "b-00001: payload 'ref_log_probs' has 1 non-finite value(s); first -inf at s-1 token 0",
    ]
    # the same verdict as through tensors (the path of a source that cannot decode without torch)
    through_tensors = validate_sources(url, [_TensorsOnly(s) for s in open_native(url)])
    assert through_tensors.to_dict()["warnings"] == report["warnings"]
    assert through_tensors.payloads_checked == report["payloads_checked"]


def test_a_damaged_payload_is_found_without_torch(tmp_path):
    url = _bundle_with_non_finite_values(tmp_path)
    store = ObjectStore.open(str(tmp_path))
    spec = open_native(url)[0].manifest.payloads["kl"]
    chunk = store.record(spec.digest).chunks[-1].digest
    data = bytearray(store.backend.read(object_key(chunk)))
    data[-3] ^= 0x01
    store.backend.write(object_key(chunk), bytes(data))
    report, outcome = _validate_without_torch(url)
    assert outcome == {"code": 1, "torch": False}
    assert report["status"] == "invalid"
    assert len(report["problems"]) == 1 and "payload 'kl'" in report["problems"][0], report["problems"]
