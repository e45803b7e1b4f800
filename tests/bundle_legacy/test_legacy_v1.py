"""The V1 directory format: writer output, verified reading, lazy payloads, and every refusal."""

from __future__ import annotations

import io
import json
import math
import os
import pickle
from pathlib import Path

import pytest
import torch

from tests.bundle_legacy.v1_cases import Case, edit_json, make_case, replace_payload, reseal, sha256, v1_json
from trajectory_replay.bundle.legacy import (
    LegacyBundle,
    find_v1_bundles,
    is_v1_bundle,
    open_v1,
    open_v1_bundle,
    write_v1_bundle,
    write_v1_multirank,
)
from trajectory_replay.errors import BundleError, NotFoundError
from trajectory_replay.replay.source import ReplaySource


def tensor_bytes(value: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def refused(path: Path, match: str, *, load: str | None = None) -> BundleError:
    """Open `path` (and load payload `load`), expecting a one-line BundleError matching `match`."""
    with pytest.raises(BundleError, match=match) as info:
        source = open_v1_bundle(path)
        if load is not None:
            source.load_payload(load)
    assert "\n" not in str(info.value)
    return info.value


# --------------------------------------------------------------------------- round trip and layout


def test_round_trip_gives_back_documents_and_tensors(bundle: Path, case: Case) -> None:
    source = open_v1_bundle(bundle)
    assert isinstance(source, ReplaySource)
    assert source.bundle_id == "b-1" and source.rank is None
    assert source.manifest.model_dump(exclude={"payloads"}) == case.manifest.model_dump(exclude={"payloads"})
    assert source.index == case.index
    assert source.expected == case.expected
    for name, tensor in case.payloads.items():
        loaded = source.load_payload(name)
        assert loaded.dtype == torch.float32 and torch.equal(loaded, tensor), name
    spec = source.manifest.payloads
    assert {name: s.role for name, s in spec.items()} == {
        "old_log_probs": "input",
        "log_probs": "input",
        "ref_log_probs": "input",
        "entropy": "input",
        "kl": "expected",
        "advantages": "expected",
    }
    assert all(
        s.codec == "torch-pt" and s.dtype == "torch.float32" and s.shape == [8] and s.digest is None
        for s in spec.values()
    )
    assert {n: s.size for n, s in spec.items()} == {n: (bundle / "payloads" / f"{n}.pt").stat().st_size for n in spec}
    assert source.v1_digests == {n: sha256((bundle / "payloads" / f"{n}.pt").read_bytes()) for n in spec}
    assert source.sha256_metadata == {
        f: sha256((bundle / f).read_bytes()) for f in ("manifest.json", "index.json", "expected.json")
    }


def test_writer_emits_the_v1_layout(bundle: Path) -> None:
    for filename in ("manifest.json", "index.json", "expected.json", "COMPLETE"):
        data = (bundle / filename).read_bytes()
        assert data == v1_json(json.loads(data)), f"{filename} is not indent-2 sorted JSON with a newline"
    complete = json.loads((bundle / "COMPLETE").read_text())
    assert complete == {
        "ranks": [0],
        "expected_ranks": [0],
        "metadata": {f: sha256((bundle / f).read_bytes()) for f in ("manifest.json", "index.json", "expected.json")},
    }
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["format_version"] == "1.0.0"
    assert set(manifest) == {
        "format_version",
        "bundle_id",
        "producer",
        "stage_contracts",
        "payloads",
        "comparison_policy",
        "redaction",
    }
    assert set(manifest["producer"]) == {"commit", "dirty_patch_digest", "torch_version"}
    assert manifest["stage_contracts"]["reward.post_process"] == {
        "stage": "reward.post_process",
        "version": "v1",
        "capability": "recompute",
        "implementation": "reimplemented",
        "inputs": [],
        "expected_outputs": [],
    }
    assert manifest["comparison_policy"]["tolerances"] == {"reward.post_process": {"atol": 1e-5}}
    kl = bundle / "payloads" / "kl.pt"
    assert manifest["payloads"]["kl"] == {
        "name": "kl",
        "dtype": "torch.float32",
        "shape": [8],
        "bytes": kl.stat().st_size,
        "sha256": sha256(kl.read_bytes()),
    }
    # loss masks live in the index samples, never as a payload; unset project-only text fields are left out
    assert "loss_mask" not in manifest["payloads"] and not (bundle / "payloads" / "loss_mask.pt").exists()
    sample = json.loads((bundle / "index.json").read_text())["samples"][0]
    assert sample["loss_mask"] == [1, 1] and "prompt" not in sample
    assert type(torch.load(kl, weights_only=True)) is torch.Tensor


def test_writer_stores_a_view_without_its_whole_storage(tmp_path: Path, case: Case) -> None:
    big = torch.arange(100_000, dtype=torch.float32)
    case.payloads["entropy"] = big[10:18]
    source = open_v1_bundle(case.write(tmp_path / "b-1"))
    assert (tmp_path / "b-1" / "payloads" / "entropy.pt").stat().st_size < 4_000
    assert torch.equal(source.load_payload("entropy"), big[10:18])


def test_writer_keeps_nan_in_expected_values(tmp_path: Path) -> None:
    # invariant 7: a bundle reproducing a broken step must be writable; replay finds the NaN
    case = make_case(rewards=[-1.0, float("nan"), -1.0, 1.0])
    source = open_v1_bundle(case.write(tmp_path / "b-1"))
    assert math.isnan(source.expected["reward.post_process"]["rewards"][1])


# --------------------------------------------------------------------------- lazy payloads and rows


def test_rows_of_scattered_samples_use_response_length_offsets(tmp_path: Path) -> None:
    case = make_case(response_lengths=(1, 3, 2, 2))
    case.index.samples[2].loss_mask = [0, 1]
    case.payloads["log_probs"] = torch.arange(8, dtype=torch.float32)
    source = open_v1_bundle(case.write(tmp_path / "b-1"))
    assert source.load_payload("log_probs", [3, 0, 2]).tolist() == [6.0, 7.0, 0.0, 4.0, 5.0]
    assert source.load_payload("log_probs", [1]).tolist() == [1.0, 2.0, 3.0]
    assert source.load_payload("log_probs", []).numel() == 0
    mask = source.load_payload("loss_mask")
    assert mask.dtype == torch.uint8 and mask.tolist() == [1, 1, 1, 1, 0, 1, 1, 1]
    assert source.load_payload("loss_mask", [2, 0]).tolist() == [0, 1, 1]
    assert source.has_payload("loss_mask") and source.has_payload("kl") and not source.has_payload("values")
    with pytest.raises(BundleError, match=r"sample positions \[4\] out of range"):
        source.load_payload("log_probs", [0, 4])
    with pytest.raises(BundleError, match="no payload 'values'"):
        source.load_payload("values")


def test_payloads_are_verified_on_first_use_and_loaded_once(bundle: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    kl = bundle / "payloads" / "kl.pt"
    data = bytearray(kl.read_bytes())
    data[-30] ^= 0xFF  # same size: only the SHA-256 can notice
    kl.write_bytes(bytes(data))
    source = open_v1_bundle(bundle)  # opening reads no payload bytes
    loads = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: loads.append(1) or real_load(*a, **k))
    first = source.load_payload("entropy")
    assert source.load_payload("entropy", [1, 2]).tolist() == [0.5] * 4
    assert source.load_payload("entropy") is first and len(loads) == 1
    with pytest.raises(BundleError, match=r"b-1/payloads/kl\.pt: sha256 mismatch \(expected [0-9a-f]{12}…, got"):
        source.load_payload("kl")
    assert len(loads) == 1, "a payload failing its hash must never reach torch.load"


def test_verify_payloads_checks_them_all(bundle: Path) -> None:
    replace_payload(bundle, "advantages", tensor_bytes(torch.zeros(8, dtype=torch.float64)))
    source = open_v1_bundle(bundle)
    with pytest.raises(BundleError, match="advantages.pt: dtype torch.float64"):
        source.verify_payloads()


# --------------------------------------------------------------------------- refusals, in check order


def test_missing_directory_is_not_found(tmp_path: Path) -> None:
    with pytest.raises(NotFoundError, match="no such bundle directory"):
        open_v1_bundle(tmp_path / "nope")
    with pytest.raises(NotFoundError):
        open_v1(tmp_path / "nope")


def test_missing_complete_is_an_incomplete_bundle(bundle: Path) -> None:
    (bundle / "COMPLETE").unlink()
    refused(bundle, r"b-1: incomplete bundle \(COMPLETE is missing\)")


@pytest.mark.parametrize(
    "content, match",
    [
        (b"{not json", r"b-1/COMPLETE: not valid JSON"),
        (b"[1, 2]", r"b-1/COMPLETE: expected a JSON object, got list"),
        (b'{"ranks": [0], "expected_ranks": [0]}', r"b-1/COMPLETE: missing required field 'metadata'"),
        (b'{"ranks": [], "expected_ranks": [0], "metadata": {}}', r"b-1/COMPLETE: field 'ranks'"),
        (
            b'{"ranks": [0], "expected_ranks": [0], "metadata": {"manifest.json": "x", "index.json": "x", '
            b'"expected.json": "x"}}',
            r"b-1/COMPLETE: field 'metadata.manifest.json': invalid sha256",
        ),
    ],
)
def test_bad_complete(bundle: Path, content: bytes, match: str) -> None:
    (bundle / "COMPLETE").write_bytes(content)
    refused(bundle, match)


def test_ranks_short_of_expected_is_incomplete(bundle: Path) -> None:
    edit_json(bundle, "COMPLETE", lambda c: c.update(expected_ranks=[0, 1]))
    refused(bundle, r"b-1/COMPLETE: incomplete bundle \(ranks \[0\] of expected \[0, 1\]\)")


@pytest.mark.parametrize("filename", ["manifest.json", "index.json", "expected.json"])
def test_metadata_hash_mismatch(bundle: Path, filename: str) -> None:
    with open(bundle / filename, "ab") as f:
        f.write(b" ")
    refused(bundle, rf"b-1/{filename}: sha256 mismatch with COMPLETE metadata \(expected [0-9a-f]{{12}}…")


@pytest.mark.parametrize(
    "content, match",
    [
        (b'{\n  "bundle_id": "b-1",\n  "format', r"b-1/manifest.json: not valid JSON \(.* at line 3"),
        (b"", r"b-1/manifest.json: not valid JSON"),
        (b"\xff\xfe{}", r"b-1/manifest.json: not UTF-8"),
        (b'{"bundle_id": "b-1", "format_version": NaN', r"b-1/manifest.json: not valid JSON"),
    ],
)
def test_non_json_or_truncated_manifest(bundle: Path, content: bytes, match: str) -> None:
    reseal(bundle, "manifest.json", content)
    refused(bundle, match)


@pytest.mark.parametrize(
    "filename, mutate, match",
    [
        ("manifest.json", lambda d: d.pop("bundle_id"), r"b-1/manifest.json: missing required field 'bundle_id'"),
        (
            "manifest.json",
            lambda d: d.update(format_version="3.0.0"),
            r"b-1/manifest.json: field 'format_version': unsupported format_version '3.0.0': major version must be 1",
        ),
        (
            "manifest.json",
            lambda d: d["payloads"]["kl"].pop("sha256"),
            r"b-1/manifest.json: missing required field 'payloads.kl.sha256'",
        ),
        (
            "manifest.json",
            lambda d: d["payloads"]["kl"].update(name="../../kl"),
            r"b-1/manifest.json: field 'payloads.kl.name': invalid payload name",
        ),
        (
            "manifest.json",
            lambda d: d.update(redaction={"prompt": "rot13"}),
            r"b-1/manifest.json: field 'redaction': invalid redaction rule 'rot13' for field 'prompt'",
        ),
        (
            "manifest.json",
            lambda d: d["stage_contracts"]["reward.raw"].update(capability="maybe"),
            r"b-1/manifest.json: field 'stage_contracts.reward.raw.capability'",
        ),
        (
            "index.json",
            lambda d: d["samples"][1].pop("response_length"),
            r"b-1/index.json: missing required field 'samples.1.response_length'",
        ),
        (
            "index.json",
            lambda d: d["identity"].update(rollout_id=3),
            r"b-1/index.json: field 'identity': identity must have exactly one of actor_step_id, critic_step_id or "
            r"rollout_id",
        ),
        (
            "expected.json",
            lambda d: d["reward.raw"].update(raw_rewards="many"),
            r"b-1/expected.json: field 'reward.raw.raw_rewards'",
        ),
    ],
)
def test_schema_errors_name_file_and_field(bundle: Path, filename: str, mutate, match: str) -> None:
    edit_json(bundle, filename, mutate)
    refused(bundle, match)


def test_bundle_id_must_agree_between_manifest_and_index(bundle: Path) -> None:
    edit_json(bundle, "index.json", lambda d: d.update(bundle_id="b-2"))
    refused(bundle, r"b-1/index.json: bundle_id 'b-2' differs from manifest.json bundle_id 'b-1'")


def test_payload_missing(bundle: Path) -> None:
    (bundle / "payloads" / "entropy.pt").unlink()
    refused(bundle, r"b-1/payloads/entropy.pt: missing \(listed in manifest.json\)")


def test_payload_size_mismatch_is_refused_before_reading(bundle: Path) -> None:
    with open(bundle / "payloads" / "kl.pt", "ab") as f:
        f.write(b"\0" * 10_000)
    refused(bundle, r"b-1/payloads/kl.pt: size \d+ bytes differs from manifest bytes \d+")


def test_payload_sha_mismatch(bundle: Path) -> None:
    replace_payload(bundle, "kl", tensor_bytes(torch.zeros(8)), sha256="ab" * 32)
    refused(bundle, r"b-1/payloads/kl.pt: sha256 mismatch \(expected abababababab…, got [0-9a-f]{12}…\)", load="kl")


@pytest.mark.parametrize(
    "tensor, match",
    [
        (torch.zeros(8, dtype=torch.float64), r"kl.pt: dtype torch.float64 differs from manifest dtype torch.float32"),
        (torch.zeros(2, 4), r"kl.pt: shape \[2, 4\] differs from manifest shape \[8\]"),
        (torch.zeros(7), r"kl.pt: shape \[7\] differs from manifest shape \[8\]"),
    ],
)
def test_tensor_dtype_and_shape_must_match_manifest(bundle: Path, tensor: torch.Tensor, match: str) -> None:
    replace_payload(bundle, "kl", tensor_bytes(tensor))
    refused(bundle, match, load="kl")


@pytest.mark.parametrize(
    "value, got",
    [
        ({"kl": torch.zeros(8)}, "dict"),
        ([torch.zeros(8)], "list"),
        (torch.nn.Parameter(torch.zeros(8)), "Parameter"),
        (torch.zeros(8).to_sparse(), "torch.sparse_coo tensor"),
    ],
)
def test_pickle_that_is_not_a_plain_tensor(bundle: Path, value: object, got: str) -> None:
    replace_payload(bundle, "kl", tensor_bytes(value))
    refused(bundle, rf"b-1/payloads/kl.pt: not a plain tensor \(got {got}\)", load="kl")


class _Exploit:
    """Pickles to a call of os.system; loading it unsafely would create the marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("encode", [tensor_bytes, pickle.dumps], ids=["torch-zip", "raw-pickle"])
def test_malicious_pickle_is_refused_without_running(bundle: Path, tmp_path: Path, encode) -> None:
    marker = tmp_path / "PWNED"
    replace_payload(bundle, "kl", encode(_Exploit(marker)))
    error = refused(bundle, r"b-1/payloads/kl.pt: not a loadable tensor file \(", load="kl")
    assert not marker.exists()
    assert "weights_only` set to `False`" not in str(error), "must not advise loading unsafely"


class _EvalExploit:
    """Pickles to a call of builtins.eval: torch's refusal of it advises loading with weights_only=False."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (eval, (f"open({str(self.marker)!r}, 'w')",))


class _PlainObject:
    """An instance of a class the safe loader does not know (its refusal advises allowlisting it, or loading
    unsafely)."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)


@pytest.mark.parametrize("exploit", [_Exploit, _EvalExploit, _PlainObject], ids=["os-system", "eval", "class"])
@pytest.mark.parametrize(
    "encode", [tensor_bytes, lambda value: pickle.dumps(value, protocol=2)], ids=["torch-zip", "raw-pickle"]
)
def test_refusal_of_a_pickle_is_our_own_line_and_never_advises_loading_unsafely(
    bundle: Path, tmp_path: Path, exploit, encode
) -> None:
    marker = tmp_path / "PWNED"
    replace_payload(bundle, "kl", encode(exploit(marker)))
    error = str(refused(bundle, r"b-1/payloads/kl.pt: not a loadable tensor file \(", load="kl"))
    assert not marker.exists()
    for advice in ("weights_only", "add_safe_globals", "safe_globals", "trusted source", "PyTorch"):
        assert advice not in error, f"{advice!r} in {error!r}"
    assert "only plain tensors" in error, error


def test_garbage_payload_is_refused(bundle: Path) -> None:
    replace_payload(bundle, "kl", b"definitely not a torch file")
    refused(bundle, r"b-1/payloads/kl.pt: not a loadable tensor file", load="kl")


def test_loss_mask_values_must_be_binary(tmp_path: Path, case: Case) -> None:
    case.index.samples[0].loss_mask = [1, 7]
    source = open_v1_bundle(case.write(tmp_path / "b-1"))
    with pytest.raises(BundleError, match="b-1/index.json: sample 's-0' loss_mask holds values other than 0 and 1"):
        source.load_payload("loss_mask")


def test_row_selection_needs_tokens_matching_the_index(tmp_path: Path, case: Case) -> None:
    case.payloads["entropy"] = torch.zeros(9)
    source = open_v1_bundle(case.write(tmp_path / "b-1"))
    assert source.load_payload("entropy").numel() == 9  # a whole-tensor load is for the sample stage to judge
    with pytest.raises(BundleError, match="entropy.pt: 9 elements, but the index samples have 8 response tokens"):
        source.load_payload("entropy", [0])


# --------------------------------------------------------------------------- writer refusals


def test_writer_refuses_structural_problems(tmp_path: Path, case: Case) -> None:
    with pytest.raises(BundleError, match="V1 keeps loss masks in index.json samples"):
        write_v1_bundle(
            tmp_path / "a",
            case.manifest,
            case.index,
            case.expected,
            {**case.payloads, "loss_mask": torch.ones(8, dtype=torch.uint8)},
        )
    with pytest.raises(BundleError, match="expected a torch.Tensor, got list"):
        write_v1_bundle(tmp_path / "b", case.manifest, case.index, case.expected, {"kl": [0.0] * 8})
    with pytest.raises(BundleError, match="invalid payload name '../kl'"):
        write_v1_bundle(tmp_path / "c", case.manifest, case.index, case.expected, {"../kl": torch.zeros(8)})
    other = case.index.model_copy(update={"bundle_id": "b-2"})
    with pytest.raises(BundleError, match="manifest bundle_id 'b-1' differs from index bundle_id 'b-2'"):
        write_v1_bundle(tmp_path / "d", case.manifest, other, case.expected, case.payloads)
    with pytest.raises(BundleError, match=r"ranks \[1\] are not all in expected_ranks \[0\]"):
        write_v1_bundle(
            tmp_path / "e", case.manifest, case.index, case.expected, case.payloads, ranks=[1], expected_ranks=[0]
        )
    assert not any((tmp_path / d / "COMPLETE").exists() for d in "abcde")


def test_writer_never_rewrites_a_finished_bundle(bundle: Path, case: Case) -> None:
    before = (bundle / "COMPLETE").read_bytes()
    with pytest.raises(BundleError, match="b-1/COMPLETE: already exists"):
        case.write(bundle)
    assert (bundle / "COMPLETE").read_bytes() == before
    assert not [p for p in bundle.rglob(".*") if p.is_file()], "no temp files left behind"


# --------------------------------------------------------------------------- multi-rank


def test_rank_bundle_is_refused_until_the_parent_complete_exists(tmp_path: Path) -> None:
    root = tmp_path / "b-1"
    shards = {0: make_case().shard(), 1: make_case().shard()}
    write_v1_multirank(root, shards, [0, 1], land=[0])
    assert (root / "COMPLETE.0").exists() and not (root / "COMPLETE").exists()
    refused(root / "rank-0", r"b-1/rank-0: refused until the multi-rank bundle is complete \(b-1/COMPLETE is missing\)")
    refused(root, r"b-1: incomplete bundle \(COMPLETE is missing\)")

    write_v1_multirank(root, shards, [0, 1], land=[1])
    parent = json.loads((root / "COMPLETE").read_text())
    assert parent["ranks"] == [0, 1] and set(parent["shards"]) == {"0", "1"}
    marker = json.loads((root / "COMPLETE.0").read_text())
    assert parent["shards"]["0"] == marker
    assert marker["relpath"] == "rank-0" and marker["expected_ranks"] == [0, 1]
    assert marker["actor_step_id"] == {"rollout_id": 120, "step_id": 0} and marker["rollout_id"] is None
    assert marker["metadata"]["index.json"] == sha256((root / "rank-0" / "index.json").read_bytes())
    assert marker["payloads"]["kl"] == sha256((root / "rank-0" / "payloads" / "kl.pt").read_bytes())
    assert json.loads((root / "rank-0" / "COMPLETE").read_text())["expected_ranks"] == [0, 1]

    source = open_v1_bundle(root / "rank-0")
    assert source.rank == 0 and source.bundle_id == "b-1"
    assert torch.equal(source.load_payload("kl"), torch.full((8,), -0.25))


def test_open_v1_returns_one_source_per_rank(tmp_path: Path) -> None:
    root = write_v1_multirank(tmp_path / "b-1", {1: make_case().shard(), 0: make_case().shard()}, [1, 0])
    sources = open_v1(root)
    assert [s.rank for s in sources] == [0, 1]
    assert all(isinstance(s, LegacyBundle) and s.index.samples[0].sample_id == "s-0" for s in sources)
    with pytest.raises(BundleError, match="b-1: a multi-rank bundle root; open it with open_v1"):
        open_v1_bundle(root)
    single = make_case("b-2").write(tmp_path / "b-2")
    assert [s.rank for s in open_v1(single)] == [None]


def test_parent_complete_must_list_every_expected_rank(tmp_path: Path) -> None:
    root = write_v1_multirank(tmp_path / "b-1", {0: make_case().shard(), 1: make_case().shard()}, [0, 1])
    parent = json.loads((root / "COMPLETE").read_text())
    del parent["shards"]["1"]
    parent["ranks"] = [0]
    (root / "COMPLETE").write_bytes(v1_json(parent))
    refused(root / "rank-0", r"b-1/COMPLETE: ranks \[0\] differ from expected_ranks \[0, 1\] of b-1/rank-0")


def test_parent_shard_entry_must_describe_the_rank(tmp_path: Path) -> None:
    root = write_v1_multirank(tmp_path / "b-1", {0: make_case().shard(), 1: make_case().shard()}, [0, 1])
    parent = json.loads((root / "COMPLETE").read_text())
    parent["shards"]["1"]["payloads"]["kl"] = "00" * 32
    (root / "COMPLETE").write_bytes(v1_json(parent))
    open_v1_bundle(root / "rank-0")
    refused(root / "rank-1", r"b-1/COMPLETE: shard rank-1: payloads differ from b-1/rank-1/manifest.json")
    parent["shards"]["1"]["relpath"] = "../elsewhere"
    (root / "COMPLETE").write_bytes(v1_json(parent))
    with pytest.raises(BundleError, match=r"b-1/COMPLETE: .*relpath '../elsewhere' must be 'rank-1'"):
        open_v1(root)


def test_writer_validates_the_ranks_to_land(tmp_path: Path) -> None:
    with pytest.raises(BundleError, match=r"ranks to land \[2\]"):
        write_v1_multirank(tmp_path / "b-1", {0: make_case().shard()}, [0, 1], land=[2])


def test_capture_directory_discovery(tmp_path: Path) -> None:
    make_case("b-1").write(tmp_path / "b-1")
    write_v1_multirank(tmp_path / "b-2", {0: make_case("b-2").shard()}, [0, 1])
    (tmp_path / "objects").mkdir()
    (tmp_path / "notes.txt").write_text("x")
    assert is_v1_bundle(tmp_path / "b-1") and is_v1_bundle(tmp_path / "b-2")
    assert not is_v1_bundle(tmp_path / "objects") and not is_v1_bundle(tmp_path / "notes.txt")
    assert find_v1_bundles(tmp_path) == [tmp_path / "b-1", tmp_path / "b-2"]
    with pytest.raises(NotFoundError):
        find_v1_bundles(tmp_path / "missing")


def test_deeply_nested_json_is_refused(bundle: Path) -> None:
    # json raises RecursionError here, which must not escape as a traceback
    reseal(bundle, "expected.json", b"[" * 100_000)
    refused(bundle, r"b-1/expected.json: not valid JSON")


@pytest.mark.parametrize("kind", ["fifo", "devzero"])
@pytest.mark.parametrize("filename", ["manifest.json", "index.json", "payloads/kl.pt"])
def test_file_that_is_not_a_regular_file_is_refused_without_reading(bundle: Path, kind: str, filename: str) -> None:
    """A FIFO would block the reader, /dev/zero would be read to the document bound: both are one line naming the
    file (a reader blocked on the FIFO is let through with junk, so the test fails instead of hanging)."""
    from tests.bundle.test_hostile_files import _replace, _unblocking

    path = bundle / filename
    _replace(str(path), kind)
    with _unblocking(str(path), kind):
        error = refused(bundle, rf"b-1/{filename}: ", load="kl")
    # a payload's size is checked against the manifest first: a FIFO or device there has none to match
    assert "not a regular file" in str(error) or filename.startswith("payloads/") and "size 0 bytes" in str(error)
