"""`python -m ringtrain ...` runs the command-line interface."""

from ringtrain.cli import main

raise SystemExit(main())
