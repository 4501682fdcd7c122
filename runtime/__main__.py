"""`python -m specrt.runtime ...` is the same as the `specrt` console script."""

from specrt.runtime.cli import main

raise SystemExit(main())
