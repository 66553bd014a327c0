"""Entry point for ``python -m spikefuse``."""

from spikefuse.cli import main

raise SystemExit(main())
