"""`python -m jaxserve`: the command line (jaxserve.entrypoints.cli)."""

from jaxserve.entrypoints.cli import main

raise SystemExit(main())
