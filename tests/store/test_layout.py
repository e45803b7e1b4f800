"""The names at a store root: everything the package writes there is declared in `store.layout`, no reserved name
is ever taken for a bundle (whatever it holds), and gc, fsck and ls touch only what the table gives them."""

from __future__ import annotations

import os
import shutil

import pytest

from tests.bundle.helpers import write_canonical
from tests.ops.conftest import write_ranks
from trajectory_replay.backends import open_backend
from trajectory_replay.bundle.markers import complete_key, rank_key
from trajectory_replay.bundle.schema import check_name
from trajectory_replay.bundle.status import bundle_names
from trajectory_replay.ops.fsck import check_store
from trajectory_replay.ops.gc import collect_garbage
from trajectory_replay.ops.ls import list_bundles
from trajectory_replay.store import Inventory
from trajectory_replay.store.layout import (
    FSCK,
    GC,
    INFLIGHT_DIR,
    LS,
    RESERVED_NAMES,
    ROOT_ENTRIES,
    VERDICTS_DIR,
    is_bundle_dir,
    touched_by,
)


def test_the_table_names_each_entry_once_and_gives_each_command_its_own():
    assert len(RESERVED_NAMES) == len(ROOT_ENTRIES)
    assert touched_by(GC) == ("objects", "blobs", ".inflight", ".gc")
    assert touched_by(FSCK) == ("objects", "blobs")
    assert touched_by(LS) == ()
    assert VERDICTS_DIR not in touched_by(GC) + touched_by(FSCK)


@pytest.mark.parametrize("name", sorted(RESERVED_NAMES))
def test_no_reserved_name_is_a_bundle_name(name):
    assert not is_bundle_dir(name)
    with pytest.raises(ValueError):
        check_name(name, "bundle id")


def test_everything_written_at_a_root_is_declared(tmp_path):
    root = str(tmp_path / "store")
    name = os.path.basename(write_canonical(root))
    write_ranks(root, "cohort", [0, 1], [0, 1, 2])  # an incomplete cohort
    collect_garbage(root, grace="24h")  # takes its lease and opens an epoch
    backend = open_backend(root)
    backend.probe()
    assert set(backend.list_dir()) - {name, "cohort"} <= RESERVED_NAMES
    assert bundle_names(backend) == sorted([name, "cohort"])


def test_a_reserved_directory_holding_markers_is_no_bundle(tmp_path):
    root = str(tmp_path / "store")
    bundle = write_canonical(root)
    backend = open_backend(root)
    name = os.path.basename(bundle)
    complete = backend.read(complete_key(name))
    beside = sorted(RESERVED_NAMES - set(touched_by(FSCK)))  # fsck judges every key under objects/ and blobs/
    for reserved in beside:
        backend.write(complete_key(reserved), complete)
        backend.write(rank_key(reserved, 0), b"{}")
    assert bundle_names(backend) == [name]
    assert [b.name for b in list_bundles(root).bundles] == [name]
    report = check_store(root)
    assert report.healthy and report.bundles == 1 and not report.orphaned, report.render_text()
    gc = collect_garbage(root, grace="0s")
    assert gc.removed == [], gc.removed
    assert all(backend.exists(complete_key(n)) and backend.exists(rank_key(n, 0)) for n in beside)


def test_gc_refuses_a_directory_it_deletes_under_that_links_out(tmp_path):
    root = tmp_path / "store"
    write_canonical(str(root))
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (root / VERDICTS_DIR).symlink_to(outside)  # gc deletes nothing under it: no refusal
    assert Inventory(open_backend(str(root))).links_out() == []
    shutil.rmtree(root / INFLIGHT_DIR, ignore_errors=True)
    (root / INFLIGHT_DIR).symlink_to(outside)
    assert Inventory(open_backend(str(root))).links_out() == [INFLIGHT_DIR]
