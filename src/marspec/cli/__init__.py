"""The ``marspec`` command line: thin wrappers that parse, call the library and print.

Each module registers its commands on the one Typer ``app`` (:mod:`marspec.cli.common`); importing them
here, in the order ``--help`` lists them, builds the whole command line.
"""

# isort: off
from marspec.cli import run, bench, calibrate, serve, selftest  # noqa: F401  (registers the commands)

# isort: on
from marspec.cli.common import app


def main() -> None:
    app()


__all__ = ["app", "main"]
