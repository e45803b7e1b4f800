"""Bundles: schema, writer, lazy verified reader, completion markers, and the older directory format."""

from trajectory_replay.bundle.reader import BundleReader, open_for_replay, open_native, open_sources
from trajectory_replay.bundle.writer import BundleWriter

__all__ = ["BundleReader", "BundleWriter", "open_for_replay", "open_native", "open_sources"]
