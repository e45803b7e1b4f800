"""Bundles: schema, writer, lazy verified reader, completion markers and status, addresses, and the older
directory format."""

from trajectory_replay.bundle.reader import BundleReader, open_native
from trajectory_replay.bundle.resolve import open_bundle, open_for_replay, open_sources
from trajectory_replay.bundle.writer import BundleWriter

__all__ = ["BundleReader", "BundleWriter", "open_bundle", "open_for_replay", "open_native", "open_sources"]
