"""``python -m marspec.cli``."""

from marspec.cli import main

main()
