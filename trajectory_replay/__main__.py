"""`python -m trajectory_replay` runs the CLI."""

from trajectory_replay.cli import main

main()
