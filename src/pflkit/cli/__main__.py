"""``python -m pflkit.cli``."""

from . import main

main()
