"""Adapters from training frameworks to bundles: each submodule imports its framework, and is imported only when
used (`import trajectory_replay.integrations.verl`); importing `trajectory_replay` imports none of them."""
