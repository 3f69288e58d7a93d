"""Allows `python -m ferry ...` (and `torchrun -m ferry ...`)."""

from ferry.cli.main import main

raise SystemExit(main())
