"""Mistakes a new user makes, each answered by one clear line (or done right): demo into a URL, tolerances that
are not numbers, selections that match nothing, bundles that share an anchor, paths that are not bundles,
imports onto a taken name, copies into a bundle, bundles whose last rank died before COMPLETE, output piped
into `head`, sizes in one unit system. Local stores and the real S3 test server."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import socket
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest
import typer
import typer.main
from typer.testing import CliRunner

import trajectory_replay
from tests.bundle.helpers import write_canonical
from tests.replay.cases import split_ranks, twelve_case
from trajectory_replay.backends import S3_BUCKET_RULE, location_problem, open_backend
from trajectory_replay.bundle import BundleWriter
from trajectory_replay.bundle.legacy import write_v1_bundle
from trajectory_replay.bundle.markers import complete_key
from trajectory_replay.cli import app
from trajectory_replay.demo import run_demo
from trajectory_replay.errors import BackendError, UsageError
from trajectory_replay.replay import canonical_case
from trajectory_replay.replay.compare import DEFAULT_ATOL, DEFAULT_RTOL
from trajectory_replay.store import ObjectStore
from trajectory_replay.store.digest import object_key
from trajectory_replay.store.liveness import INFLIGHT_PREFIX
from trajectory_replay.units import human_bytes

runner = CliRunner()
REPO = Path(__file__).resolve().parents[2]


def run(*args: str, env: dict | None = None):
    return runner.invoke(app, list(args), env=env)


def one_error_line(result, code: int = 1) -> str:
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("trajectory-replay: error: "), result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    return lines[0]


def write_cohort(root: str, name: str = "b-twelve", options: dict | None = None) -> str:
    """The twelve-sample case as two data-parallel ranks of one bundle (6 samples each)."""
    for rank, shard in enumerate(split_ranks(twelve_case(), [range(0, 6), range(6, 12)])):
        manifest = shard.manifest.model_copy(update={"bundle_id": name})
        index = shard.index.model_copy(update={"bundle_id": name})
        BundleWriter(
            f"{root}/{name}", manifest, index, shard.expected, rank=rank, expected_ranks=[0, 1], **(options or {})
        ).finalize(payloads=shard.payloads)
    return f"{root}/{name}"


# ---- demo ----------------------------------------------------------------------------------------


def test_demo_writes_into_the_store_a_url_names(s3_root, s3_env, tmp_path, monkeypatch):
    url, options = s3_root
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TRAJECTORY_REPLAY_CACHE_DIR", str(tmp_path / "cache"))
    result = run("demo", url)
    assert result.exit_code == 0, result.output
    assert f"wrote {url}/b-00001" in result.stdout
    backend = open_backend(url, **options)
    assert backend.exists(complete_key("b-00001")) and backend.exists(complete_key("b-00065"))
    assert not (tmp_path / "s3:").exists() and sorted(os.listdir(tmp_path)) == ["cache"]
    replayed = run("replay", f"{url}/b-00065", "--json")
    assert json.loads(replayed.stdout)["first_divergent_stage"] == "reward.post_process"


# ---- tolerances ----------------------------------------------------------------------------------


@pytest.mark.parametrize("flag", ["--atol", "--rtol"])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "-1", "-0.001"])
def test_tolerance_must_be_a_finite_number_not_below_zero(tmp_path, flag, value):
    bundle = write_canonical(str(tmp_path / "store"), buggy=True)
    result = run("replay", bundle, f"{flag}={value}")
    line = one_error_line(result, 2)
    assert flag in line and "finite number >= 0" in line and result.stdout == ""
    doc = json.loads(run("replay", bundle, f"{flag}={value}", "--json").stdout)
    assert doc["status"] == "usage" and flag in doc["error"]
    assert run("replay", bundle, f"{flag}=0").exit_code == 1  # zero is a tolerance: the bug is still found


# ---- selections ----------------------------------------------------------------------------------


def test_selection_errors_name_the_valid_ids(tmp_path):
    bundle = write_canonical(str(tmp_path / "store"))
    assert "no group '1'; groups: g-0, g-1 " in one_error_line(run("replay", bundle, "--group", "1"))
    assert "no batch 'mb-9'; batches: mb-0007, mb-0008 " in one_error_line(run("replay", bundle, "--batch", "mb-9"))
    cohort = write_cohort(str(tmp_path / "store"))
    line = one_error_line(run("replay", cohort + "/rank-0", "--sample", "s-0"))
    assert "no sample 's-0'; samples: q-0, q-1, q-2, q-3, q-4, q-5 " in line  # the rank's own samples
    twelve = twelve_case()
    BundleWriter(
        str(tmp_path / "store" / "b-all"),
        twelve.manifest.model_copy(update={"bundle_id": "b-all"}),
        twelve.index.model_copy(update={"bundle_id": "b-all"}),
        twelve.expected,
    ).finalize(payloads=twelve.payloads)
    line = one_error_line(run("replay", str(tmp_path / "store" / "b-all"), "--sample", "s-0"))
    listed = re.search(r"samples: (.*?) \(selection", line).group(1)
    assert listed == "q-0, q-1, q-2, q-3, q-4, q-5, q-6, q-7, q-8, q-9, ... (2 more)"  # ten, then a count


def test_bundles_sharing_an_anchor_are_picked_by_path(tmp_path):
    root = str(tmp_path / "store")
    write_canonical(root, buggy=True)  # b-00065, step 120:0
    write_canonical(root, name="rerun")  # also step 120:0
    for args in (["replay", root], ["replay", root, "--step", "120:0"]):
        line = one_error_line(run(*args))
        assert "share an anchor" in line and "--step/--critic/--rollout cannot tell apart" in line
        suggested = re.search(r"give one bundle's path instead, e.g. (\S+)$", line).group(1)
        assert suggested == f"{root}/b-00065"
        assert run("replay", suggested).exit_code == 1  # the path it names works (the buggy bundle diverges)


# ---- inspect -------------------------------------------------------------------------------------


def test_inspect_of_a_directory_that_is_not_a_bundle(tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "readme.txt").write_text("hello")
    line = one_error_line(run("inspect", str(tmp_path / "notes")))
    assert "notes: not a bundle" in line
    doc = json.loads(run("inspect", str(tmp_path / "notes"), "--json").stdout)
    assert doc["status"] == "selection" and "not a bundle" in doc["error"]
    store = str(tmp_path / "store")
    write_canonical(store)
    assert "store: not a bundle" in one_error_line(run("inspect", store))  # a store root is not a bundle either
    assert "no such bundle" in one_error_line(run("inspect", str(tmp_path / "absent")))


def test_inspect_of_a_multi_rank_bundle_shows_its_cohort(tmp_path):
    cohort = write_cohort(str(tmp_path / "store"))
    result = run("inspect", cohort)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert "  ranks      0, 1 (all landed)" in lines
    assert "  samples    12 (31 response tokens; rank 0: 6, rank 1: 6)" in lines
    for text in (result.stdout, run("validate", cohort).stdout, run("inspect", f"{cohort}/rank-1").stdout):
        assert not re.search(r"\[None\]|\['-'\]|\bNone\b|\[\d+(, \d+)*\] of", text), text
    assert "ranks 0, 1" in run("validate", cohort).stdout
    single = write_canonical(str(tmp_path / "store"))
    assert "ranks" not in run("validate", single).stdout  # a single producer has no ranks to show
    doc = json.loads(run("inspect", cohort, "--json").stdout)
    assert doc["samples"] == 12 and doc["rank_samples"] == {"0": 6, "1": 6} and doc["ranks"] == [0, 1]
    one = json.loads(run("inspect", f"{cohort}/rank-1", "--json").stdout)
    assert one["samples"] == 12 and one["rank_samples"] == {"0": 6, "1": 6}


# ---- import --------------------------------------------------------------------------------------


def _v1(path: Path, buggy: bool) -> Path:
    case = canonical_case(buggy=buggy)
    return write_v1_bundle(path, case.manifest, case.index, case.expected, case.payloads)


def _keys(root: str) -> set[str]:
    return set(open_backend(root).list(""))


def test_import_onto_a_taken_name_suggests_as_and_leaves_nothing(tmp_path):
    store = str(tmp_path / "store")
    write_canonical(store, name="b-00065")  # the clean step under the name the buggy V1 bundle has
    before = _keys(store)
    line = one_error_line(run("import", str(_v1(tmp_path / "v1" / "b-00065", buggy=True)), store))
    assert "b-00065: a different bundle with this name already exists" in line and "--as NAME" in line
    assert "different content" in line
    assert _keys(store) == before  # no in-flight record, no object: nothing it wrote is left
    assert not open_backend(store).list(INFLIGHT_PREFIX)
    # the way out works, and importing the same bundle again is a no-op that leaves nothing either
    assert run("import", str(tmp_path / "v1" / "b-00065"), store, "--as", "b-00065-v1").exit_code == 0
    after = _keys(store)
    assert run("import", str(tmp_path / "v1" / "b-00065"), store, "--as", "b-00065-v1").exit_code == 0
    assert _keys(store) == after
    clash = one_error_line(run("import", str(tmp_path / "v1" / "b-00065"), store, "--as", "b-00065"))
    assert "choose another name with --as NAME" in clash and _keys(store) == after


def test_import_onto_a_taken_name_on_s3_leaves_nothing(s3_root, s3_env, tmp_path, monkeypatch):
    url, options = s3_root
    monkeypatch.setenv("TRAJECTORY_REPLAY_CACHE_DIR", str(tmp_path / "cache"))
    write_canonical(url, name="b-00065", storage_options=options)
    backend = open_backend(url, **options)
    before = set(backend.list(""))
    line = one_error_line(run("import", str(_v1(tmp_path / "v1" / "b-00065", buggy=True)), url))
    assert "--as NAME" in line and set(backend.list("")) == before
    assert run("import", str(tmp_path / "v1" / "b-00065"), url, "--as", "other").exit_code == 0
    assert backend.exists(complete_key("other")) and not backend.list(INFLIGHT_PREFIX)


def test_import_onto_a_taken_multi_rank_name_is_refused(tmp_path):
    store = str(tmp_path / "store")
    write_cohort(store, name="b-00001")  # a two-rank bundle under the name of the V1 single producer
    before = _keys(store)
    line = one_error_line(run("import", str(_v1(tmp_path / "v1" / "b-00001", buggy=False)), store))
    assert "--as NAME" in line and _keys(store) == before


# ---- cp ------------------------------------------------------------------------------------------


def test_cp_into_a_bundle_or_onto_itself_is_refused(tmp_path):
    root = str(tmp_path / "store")
    bundle = write_canonical(root)
    before = _keys(root)
    for dest in (bundle, f"{bundle}/copy", f"{bundle}/rank-0"):
        line = one_error_line(run("cp", bundle, dest, "--quiet"), 2)
        assert f"inside the bundle {bundle}" in line
    assert "the source store itself" in one_error_line(run("cp", bundle, root, "--quiet"), 2)
    assert "the source store itself" in one_error_line(run("cp", root, root + "/", "--all", "--quiet"), 2)
    v1 = _v1(tmp_path / "v1" / "b-old", buggy=False)
    assert f"inside the bundle {v1}" in one_error_line(run("cp", bundle, str(v1 / "x"), "--quiet"), 2)
    assert _keys(root) == before and not (v1 / "x").exists()
    assert run("cp", bundle, str(tmp_path / "other"), "--quiet").exit_code == 0  # a real destination works


def test_cp_into_an_s3_bundle_is_refused(s3_root, s3_env, tmp_path):
    url, options = s3_root
    remote = write_canonical(url, storage_options=options)
    local = write_canonical(str(tmp_path / "store"), name="local")
    before = set(open_backend(url, **options).list(""))
    line = one_error_line(run("cp", local, f"{remote}/nested", "--quiet"), 2)
    assert f"inside the bundle {remote}" in line
    assert set(open_backend(url, **options).list("")) == before


# ---- finalizable bundles -------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["local", "s3"])
@pytest.mark.parametrize("command", ["ls", "replay", "replay-root", "inspect", "validate"])
def test_finalizable_bundles_are_finalized_by_readers(where, command, request, tmp_path, monkeypatch):
    if where == "s3":
        root, options = request.getfixturevalue("s3_root")
        request.getfixturevalue("s3_env")
        monkeypatch.setenv("TRAJECTORY_REPLAY_CACHE_DIR", str(tmp_path / "cache"))
    else:
        root, options = str(tmp_path / "store"), {}
    bundle = write_cohort(root, options=options)
    backend = open_backend(root, **options)
    backend.delete(complete_key("b-twelve"))  # the last rank died after landing its marker
    assert not backend.exists(complete_key("b-twelve"))
    args = {
        "ls": ["ls", root],
        "replay": ["replay", bundle],
        "replay-root": ["replay", root, "--rollout", "3"],
        "inspect": ["inspect", bundle],
        "validate": ["validate", bundle],
    }[command]
    result = run(*args, "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["status"] == "pass"
    assert backend.exists(complete_key("b-twelve"))
    if command == "ls":
        assert doc["finalized"] == ["b-twelve"] and doc["bundles"][0]["status"] == "complete"
    if command == "inspect":
        assert doc["state"] == "complete" and "finalized now" in doc["detail"]


# ---- pipes and units ------------------------------------------------------------------------------


def _piped(command: list[str], reader: str, tmp_path: Path) -> tuple[int, str]:
    """Run the CLI as its own process with stdout piped into `reader` (another process): (exit code, stderr)."""
    err = tmp_path / "stderr.txt"
    cli = " ".join([sys.executable, "-m", "trajectory_replay", *command])
    shell = f"{cli} 2>{err} | {reader}; exit ${{PIPESTATUS[0]}}"
    out = subprocess.run(["bash", "-c", shell], cwd=REPO, capture_output=True, text=True, timeout=120)
    return out.returncode, err.read_text()


def test_output_piped_into_head_ends_quietly(tmp_path):
    root = str(tmp_path / "store")
    bundle = write_canonical(root, buggy=True)
    store = ObjectStore(open_backend(root))
    for i in range(1200):  # garbage enough that `gc --dry-run` lists far more than a pipe holds
        store.put_object(f"orphan {i}".encode())
    code, err = _piped(["gc", root, "--grace", "0s", "--dry-run", "--quiet"], "head -n 1", tmp_path)
    assert (code, err) == (0, "")
    code, err = _piped(["replay", bundle], "head -n 0", tmp_path)  # the reader is gone before the first line
    assert (code, err) == (1, "")  # the verdict's exit code stays


def test_sizes_use_iec_units_and_ls_agrees_with_stats(tmp_path):
    root = str(tmp_path / "store")
    write_canonical(root, buggy=True)
    write_canonical(root, buggy=False, name="clean")  # shares every payload but the advantages
    write_cohort(root)
    ls = json.loads(run("ls", root, "--json").stdout)
    stats = json.loads(run("stats", root, "--json").stdout)
    assert (ls["logical_bytes"], ls["stored_bytes"]) == (stats["logical_bytes"], stats["stored_bytes"])
    assert ls["complete_bundles"] == stats["complete_bundles"] == 3
    assert stats["stored_bytes"] < sum(b["stored_bytes"] for b in ls["bundles"])  # shared chunks counted once
    alone = str(tmp_path / "alone")
    write_canonical(alone)
    (row,) = json.loads(run("ls", alone, "--json").stdout)["bundles"]
    assert row["stored_bytes"] == json.loads(run("stats", alone, "--json").stdout)["stored_bytes"]
    text = run("ls", root).stdout + run("stats", root).stdout + run("inspect", f"{root}/clean").stdout
    text += run("validate", f"{root}/clean").stdout + run("gc", root, "--dry-run", "--quiet").stdout
    text += run("fsck", root, "--quiet").stdout + run("cp", root, str(tmp_path / "copy"), "--all", "--quiet").stdout
    assert f"{human_bytes(stats['stored_bytes'])} stored" in text
    assert not re.search(r"\d ?(kB|KB|MB|GB|bytes)\b", text), text  # one unit system: B, KiB, MiB, ...
    assert re.search(r"\d KiB|\d B\b", text)


# ---- ls ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["record", "marker"])
def test_ls_names_a_corrupt_bundle_once(tmp_path, damage):
    root = str(tmp_path / "store")
    write_canonical(root, name="b-bad")
    backend = open_backend(root)
    if damage == "record":  # the manifest's record no longer hashes to its digest
        marker = json.loads(backend.read(complete_key("b-bad")))
        backend.write(object_key(marker["shards"]["0"]["manifest"]["record"]), b"garbage")
    else:
        backend.write(complete_key("b-bad"), b"{not json")
    result = run("ls", root)
    assert result.exit_code == 0, result.output
    (line,) = [line for line in result.stdout.splitlines() if "b-bad" in line and ": " in line]  # not the row
    assert line.count("b-bad") == 1 and line.startswith("b-bad: "), line
    assert "does not match its digest" in line if damage == "record" else "b-bad: COMPLETE: not valid JSON" in line


# ---- paths and URLs that name no store -----------------------------------------------------------

JSON_COMMANDS = {"replay", "conventions", "diff", "inspect", "validate", "ls", "scan", "cp", "gc", "fsck", "stats"}
BAD_LOCATIONS = {  # as typed -> what the one line must say
    "s3://": "s3://: no bucket name: an S3 URL is s3://BUCKET/PREFIX",
    "s3:///x": "s3:///x: no bucket name: an S3 URL is s3://BUCKET/PREFIX",
    "s3://BAD_bucket!/x": f"s3://BAD_bucket!/x: invalid S3 bucket name 'BAD_bucket!': a bucket name is "
    f"{S3_BUCKET_RULE}",
    "s3://ab/x": f"s3://ab/x: invalid S3 bucket name 'ab': a bucket name is {S3_BUCKET_RULE}",
    "s3://user:secret@Bucket/x": "s3://Bucket/x: credentials in an S3 URL are not used; give them through "
    "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, an AWS profile, or the key and "
    "secret storage options",
    "s3:/bucket/x": "s3:/bucket/x: not a URL (no // after s3:): write s3://...",
    "http://host/x": "http://host/x: unsupported storage protocol 'http' (use a path, file://, s3:// or memory://)",
    "": "empty path: give a directory or a URL such as s3://bucket/prefix",
}
LOCATION_ARGUMENTS = [  # every path or URL a command takes; {x} is the mistake, {ok} a real store or bundle
    (["replay", "{x}"], "BUNDLE-OR-DIR"),
    (["conventions", "{x}"], "BUNDLE-OR-DIR"),
    (["diff", "{x}", "{ok}"], "A"),
    (["diff", "{ok}", "{x}"], "B"),
    (["inspect", "{x}"], "BUNDLE-OR-DIR"),
    (["validate", "{x}"], "BUNDLE-OR-DIR"),
    (["import", "{x}", "{root}"], "V1-BUNDLE-OR-DIR"),
    (["import", "{v1}", "{x}"], "STORE-ROOT"),
    (["demo", "{x}"], "DIR-OR-URL"),
    (["ls", "{x}"], "ROOT"),
    (["scan", "{x}"], "STORE-OR-CAPTURE"),
    (["cp", "{x}", "{dest}"], "BUNDLE-OR-ROOT"),
    (["cp", "{ok}", "{x}"], "DEST-ROOT"),
    (["gc", "{x}"], "ROOT"),
    (["fsck", "{x}"], "ROOT"),
    (["fsck", "{root}", "--repair-from", "{x}"], "--repair-from"),
    (["stats", "{x}"], "ROOT"),
    (["export", "{x}", "{dest}"], "BUNDLE"),
    (["export", "{ok}", "{x}"], "OUT-DIR"),
]


@pytest.fixture
def places(tmp_path, monkeypatch):
    """A store with a bundle, a V1 bundle and a free destination; the current directory is an empty one."""
    root = str(tmp_path / "store")
    places = {
        "root": root,
        "ok": write_canonical(root),
        "v1": str(_v1(tmp_path / "v1" / "b-old", buggy=False)),
        "dest": str(tmp_path / "dest"),
    }
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    return places


@pytest.mark.parametrize("typed", list(BAD_LOCATIONS))
def test_every_command_refuses_a_location_that_names_no_store_the_same_way(places, tmp_path, typed):
    before = _keys(places["root"])
    for template, name in LOCATION_ARGUMENTS:
        argv = [a.format(x=typed, **places) for a in template]
        line = one_error_line(run(*argv), 2)
        said = line.removeprefix("trajectory-replay: error: ")
        expected = BAD_LOCATIONS[typed] if typed else f"{name}: {BAD_LOCATIONS[typed]}"
        assert said == f"{expected} (see `trajectory-replay {argv[0]} --help`)", argv
        assert ":secret@" not in line and "regex" not in line
        doc = json.loads(run(*argv, "--json").stdout)
        if argv[0] in JSON_COMMANDS:
            assert doc == {"status": "usage", "error": said}, argv
        else:  # a command without --json still answers a line with it in one object
            assert doc["status"] == "usage" and "No such option: --json" in doc["error"], argv
    assert os.listdir(tmp_path / "cwd") == []  # `demo s3://` wrote no local ./s3: directory, `demo ''` no demo
    assert _keys(places["root"]) == before and not os.path.exists(places["dest"])


def test_open_backend_refuses_an_invalid_bucket_before_any_request():
    with pytest.raises(BackendError) as info:
        open_backend("s3://BAD_bucket!/x", endpoint_url="http://127.0.0.1:9")  # nothing listens there
    assert str(info.value) == BAD_LOCATIONS["s3://BAD_bucket!/x"]
    assert location_problem("s3://my-bucket.v2/run-42") is None and location_problem("relative/dir") is None


# ---- options and help ----------------------------------------------------------------------------


def _commands():
    return typer.main.get_command(app).commands


def _value_options(command) -> list[str]:
    return [p.opts[0] for p in command.params if p.param_type_name == "option" and not p.is_flag]


def test_an_option_missing_its_value_does_not_swallow_json(places):
    checked = 0
    for name, command in _commands().items():
        args = [places["ok"]] * sum(p.param_type_name == "argument" and p.required for p in command.params)
        for option in _value_options(command):
            for line in ([name, *args, option, "--json"], [name, option, "--json", *args]):
                result = run(*line)
                assert result.exit_code == 2, (line, result.output)
                doc = json.loads(result.stdout)  # one object: the JSON flag was not taken as the option's value
                assert (
                    doc["status"] == "usage" and f"{option} is missing its value (--json is an option)" in doc["error"]
                ), line
                assert result.stderr.strip() == f"trajectory-replay: error: {doc['error']}"
                checked += 1
    assert checked >= 2 * 25
    line = one_error_line(run("replay", places["ok"], "--sample", "--stage", "reward.post_process"), 2)
    assert "--sample is missing its value (--stage is an option): write --sample ID" in line
    doc = json.loads(run("replay", places["ok"], "--set", "name=--json", "--json").stdout)  # a value may hold --
    assert "unknown config field 'name'" in doc["error"] and "missing its value" not in doc["error"]


def test_version():
    result = run("--version")
    assert (result.exit_code, result.stdout) == (0, f"trajectory-replay {trajectory_replay.__version__}\n")


@pytest.mark.parametrize("name", ["", *sorted(typer.main.get_command(app).commands)])
def test_help_reads_as_a_persons_cli(name):
    command = _commands().get(name)
    result = run(*([name] if name else []), "--help", env={"COLUMNS": "80", "TERMINAL_WIDTH": "80"})
    assert result.exit_code == 0, result.output
    text = result.stdout
    assert not re.search(r"<(bool|str|int|float|list\[str\]|path)>|\{\w+\}", text), text  # no Python types
    assert max(len(line) for line in text.splitlines()) <= 80
    if command is None:
        assert "--version" in text
        return
    assert "\n" not in (command.help or "").split("\n\n")[0]  # sentences are not broken where the source was
    rows = {line.split()[1]: line.split()[2:] for line in text.splitlines() if re.match(r"│ --", line)}
    for param in command.params:
        if param.param_type_name != "option":
            assert param.metavar and param.metavar in text.split("\n\n")[0] + text, param.name  # Usage: ... PATH
            continue
        words = rows[param.opts[0]]
        if param.is_flag:
            assert words[0] not in ("BOOL", "BOOLEAN"), (param.opts, words)
        else:
            assert param.metavar and words[0 if len(param.opts) == 1 else 1] == param.metavar, (param.opts, words)
    if "--atol" in rows:
        words = " ".join(text.replace("│", "").split())
        defaults = re.findall(r"per stage, else (\S+)\)", words)  # --atol's, then --rtol's
        assert [float(d) for d in defaults] == [DEFAULT_ATOL, DEFAULT_RTOL], defaults


# ---- sizes and widths of the human reports -------------------------------------------------------


def test_diff_and_html_pages_show_sizes_in_iec_units(tmp_path):
    root = str(tmp_path / "store")
    buggy, clean = write_canonical(root, buggy=True), write_canonical(root, name="clean")
    for args in (["diff", buggy, clean], ["replay", buggy], ["scan", root, "--quiet", "--workers", "1"]):
        page = tmp_path / f"{args[0]}.html"
        result = run(*args, "--html", str(page))
        assert result.exit_code == 1, result.output  # the buggy bundle differs / diverges
        assert result.stderr.strip() == f"trajectory-replay: wrote {page} ({human_bytes(page.stat().st_size)})"
        assert not re.search(r"\d ?(kB|KB|MB|GB|bytes)\b", result.stdout + result.stderr), result.output
    fetched = run("diff", buggy, clean).stdout.splitlines()[-1]
    assert re.fullmatch(r"fetched from the stores: \d+(\.\d)? (B|KiB|MiB)", fetched), fetched


def _on_terminal(args: list[str], columns: int) -> str:
    """What the CLI, as its own process whose stdout is a terminal `columns` wide (a pseudo-terminal), shows."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}  # the terminal's own width
    proc = subprocess.Popen(
        [sys.executable, "-m", "trajectory_replay", *args], stdout=slave, stderr=subprocess.DEVNULL, cwd=REPO, env=env
    )
    os.close(slave)
    shown = []
    try:
        while data := os.read(master, 65536):
            shown.append(data)
    except OSError:  # EIO: the process closed the terminal
        pass
    finally:
        os.close(master)
    assert proc.wait(timeout=120) in (0, 1)
    return b"".join(shown).decode().replace("\r\n", "\n")


def test_inspect_and_diff_fit_a_narrow_terminal(tmp_path):
    root = str(tmp_path / ("a-store-with-a-rather-long-directory-name-" * 2))
    long_id = "b-" + "nightly-grpo-run-with-a-descriptive-name-" * 2 + "00065"
    buggy, clean = write_canonical(root, name=long_id, buggy=True), write_canonical(root, name="clean")
    piped = run("inspect", buggy, env={"COLUMNS": "80"}).stdout + run("diff", buggy, clean).stdout
    assert max(map(len, piped.splitlines())) > 80  # the case is a real one
    assert f"bundle {long_id} [native]" in piped  # piped: whole lines for the tools reading them
    for args in (["inspect", buggy], ["diff", buggy, clean]):
        shown = _on_terminal(args, 80)
        lines = shown.splitlines()
        assert len(lines) > 10 and max(map(len, lines)) <= 80, "\n".join(line for line in lines if len(line) > 80)
        assert long_id in "".join(shown.split())  # wrapped, not lost
        if args[0] == "diff":
            assert lines[0].startswith("diff ") and lines[1].startswith("  ")  # the long header wraps, indented
            assert any(line.endswith("…") or "… " in line for line in lines)  # a long field name is cut
            assert lines[-1].startswith("fetched from the stores: ")


# ---- scan on Ray ---------------------------------------------------------------------------------


def test_a_malformed_ray_address_is_refused_also_when_every_verdict_is_cached(tmp_path):
    root = str(tmp_path / "store")
    write_canonical(root)
    first = run("scan", root, "--quiet", "--workers", "1", "--json")
    assert json.loads(first.stdout)["status"] == "pass"  # the verdict is stored: a re-scan replays nothing
    for address in ("nonsense", "127.0.0.1", "ray://host:99999", "host:port", ""):
        line = one_error_line(run("scan", root, "--engine", "ray", "--ray-address", address, "--quiet"), 2)
        assert f"--ray-address {address!r}: expected HOST:PORT, ray://HOST:PORT, auto or local" in line


def test_an_unreachable_ray_cluster_is_an_io_error_not_a_usage_error(tmp_path):
    root = str(tmp_path / "store")
    write_canonical(root)
    with socket.socket() as probe:  # a port nothing listens on: bound here, never listened on
        probe.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{probe.getsockname()[1]}"
        line = one_error_line(run("scan", root, "--engine", "ray", "--ray-address", address, "--quiet"), 1)
        assert f"cannot reach the Ray cluster at {address}: " in line and "--ray-address or RAY_ADDRESS" in line
        doc = json.loads(run("scan", root, "--engine", "ray", "--ray-address", address, "--quiet", "--json").stdout)
    assert doc["status"] == "io" and doc["error"] == line.removeprefix("trajectory-replay: error: ")


@pytest.mark.parametrize("typed", ["s3://", "s3:///x", "", "s3:/bucket/x"])
def test_run_demo_refuses_a_location_that_names_no_store(typed, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError) as info:
        run_demo(typed)
    assert str(info.value) == BAD_LOCATIONS[typed] and os.listdir(tmp_path) == []
