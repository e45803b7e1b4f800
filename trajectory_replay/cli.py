"""The `trajectory-replay` command line: thin wrappers over the Python API."""

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)


def main() -> None:
    """Console-script entry point."""
    app()
