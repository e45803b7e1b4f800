"""A redaction policy is checked when a bundle is written and left alone when one is read.

A policy naming a field the samples do not have (`Prompt` for `prompt`) used to be ignored, so
the text it was meant to hide was stored in clear. The writer now refuses it with one line that
lists the fields a policy may name; a bundle already written with such a policy still opens.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from trajectory_replay.bundle import BundleReader, BundleWriter
from trajectory_replay.bundle.documents import compact_json
from trajectory_replay.bundle.legacy import write_v1_bundle
from trajectory_replay.bundle.markers import DocRef, Documents, complete_key, read_complete
from trajectory_replay.bundle.redaction import REDACTABLE_FIELDS, check_policy
from trajectory_replay.cli import app
from trajectory_replay.errors import BundleError
from trajectory_replay.replay import canonical_case
from trajectory_replay.store import ObjectStore

runner = CliRunner()
SECRET = "the secret prompt"
KNOWN = ", ".join(REDACTABLE_FIELDS)


def _case(redaction: dict, name: str = "b-00001"):
    case = canonical_case(buggy=False)
    index = case.index.model_copy(
        update={"bundle_id": name, "samples": [s.model_copy(update={"prompt": SECRET}) for s in case.index.samples]}
    )
    # model_copy skips validation, as the importer's and capture's manifests do
    manifest = case.manifest.model_copy(update={"bundle_id": name, "redaction": redaction})
    return case, manifest, index


def _write(root: Path, redaction: dict, name: str = "b-00001") -> str:
    case, manifest, index = _case(redaction, name)
    writer = BundleWriter(f"{root}/{name}", manifest, index, case.expected)
    writer.finalize(payloads=case.payloads)
    return f"{root}/{name}"


def _one_line(exc: BaseException, *needles: str) -> str:
    text = str(exc)
    assert "\n" not in text, text
    for needle in needles:
        assert needle in text, text
    return text


def test_known_field_is_applied(tmp_path):
    """The control: `prompt` (exact spelling) is hashed before it is stored."""
    url = _write(tmp_path / "store", {"prompt": "hash"})
    stored = BundleReader.open(url).index.samples[0].prompt
    assert stored is not None and stored.startswith("blake3:") and SECRET not in stored


@pytest.mark.parametrize("field", ["Prompt", "PROMPT", "prompts", "reward", "sample_id"])
def test_unknown_field_refused_when_the_writer_is_built(tmp_path, field):
    root = tmp_path / "store"
    case, manifest, index = _case({field: "hash"})
    with pytest.raises(BundleError) as info:
        BundleWriter(f"{root}/b-00001", manifest, index, case.expected)
    _one_line(info.value, "b-00001", "redaction", repr(field), f"known fields: {KNOWN}")
    if field.lower() == "prompt":
        assert "did you mean 'prompt'?" in str(info.value)
    assert not root.exists(), "nothing may be stored for a refused policy"


def test_unknown_field_refused_from_a_manifest_mapping(tmp_path):
    case, manifest, index = _case({})
    doc = manifest.model_dump(mode="json")
    doc["redaction"] = {"prompt": "hash", "Response": "drop", "label": "truncate:3"}
    with pytest.raises(BundleError) as info:
        BundleWriter(f"{tmp_path}/store/b-00001", doc, index, case.expected)
    _one_line(info.value, "'Response' (did you mean 'response'?)", KNOWN)


@pytest.mark.parametrize("rule", ["rot13", "truncate:²", "truncate:", "truncate:-1", 5])
def test_invalid_rule_on_an_unvalidated_manifest_is_a_one_line_error(tmp_path, rule):
    """A model built with model_copy skips the schema's rule check; the writer still refuses it (no ValueError
    traceback at finalize, and `truncate:²` passed str.isdigit but not int())."""
    case, manifest, index = _case({"prompt": rule})
    with pytest.raises(BundleError) as info:
        BundleWriter(f"{tmp_path}/store/b-00001", manifest, index, case.expected)
    _one_line(info.value, "redaction.prompt", "expected hash, drop or truncate:N")


def test_policy_swapped_after_construction_refused_at_finalize(tmp_path):
    root = tmp_path / "store"
    case, manifest, index = _case({"prompt": "hash"})
    writer = BundleWriter(f"{root}/b-00001", manifest, index, case.expected)
    writer.manifest = writer.manifest.model_copy(update={"redaction": {"Prompt": "hash"}})
    with pytest.raises(BundleError) as info:
        writer.finalize(payloads=case.payloads)
    _one_line(info.value, "'Prompt'", KNOWN)
    assert read_complete(ObjectStore.open(root).backend, "b-00001") is None


def test_check_policy_bounds_its_message():
    text = _one_line(
        pytest.raises(BundleError, check_policy, {f"f{i}": "hash" for i in range(1000)}, "b").value, "and 995 more"
    )
    assert len(text) < 400


def test_bundle_written_with_an_unknown_field_still_reads(tmp_path):
    """A bundle stored before the check, whose manifest names `Prompt`, opens, validates, replays and inspects;
    inspect says the field was not applied."""
    root = tmp_path / "store"
    url = _write(root, {})
    store = ObjectStore.open(root)
    marker = read_complete(store.backend, "b-00001")
    docs = marker.documents()
    manifest = json.loads(store.get(docs.manifest.blob_ref()))
    manifest["redaction"] = {"Prompt": "hash"}
    new_docs = Documents(
        manifest=DocRef.of(store.put(compact_json(manifest))), index=docs.index, expected=docs.expected
    )
    store.backend.write(
        complete_key("b-00001"),
        compact_json(marker.model_copy(update={"shards": {"0": new_docs}}).model_dump(mode="json")),
    )

    reader = BundleReader.open(url)
    assert reader.manifest.redaction == {"Prompt": "hash"} and reader.index.samples[0].prompt == SECRET
    for command in ("validate", "replay"):
        result = runner.invoke(app, [command, url])
        assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["inspect", url])
    assert result.exit_code == 0, result.output
    assert "  redaction  Prompt=hash (not a redactable field: was not applied)" in result.stdout.splitlines()


def test_import_refuses_an_unknown_field_with_one_line(tmp_path):
    case, manifest, index = _case({"Prompt": "hash"}, name="b-00065")
    v1 = write_v1_bundle(tmp_path / "v1" / "b-00065", manifest, index, case.expected, case.payloads)
    store = tmp_path / "store"
    result = runner.invoke(app, ["import", str(v1), str(store)])
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("trajectory-replay: error:"), result.stderr
    assert "'Prompt'" in lines[0] and KNOWN in lines[0] and "Traceback" not in result.output
    assert not (store / "b-00065").exists()
    # with the field spelled right the same bundle imports, the prompt hashed
    _, fixed, _ = _case({"prompt": "hash"}, name="b-00066")
    v1_ok = write_v1_bundle(
        tmp_path / "v1" / "b-00066",
        fixed,
        index.model_copy(update={"bundle_id": "b-00066"}),
        case.expected,
        case.payloads,
    )
    assert runner.invoke(app, ["import", str(v1_ok), str(store)]).exit_code == 0
    assert SECRET not in (BundleReader.open(f"{store}/b-00066").index.samples[0].prompt or "")
