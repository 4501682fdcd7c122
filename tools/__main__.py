"""`python -m specrt.tools ...` is the same as the `specrt` console script."""

from specrt.tools.cli import main

raise SystemExit(main())
