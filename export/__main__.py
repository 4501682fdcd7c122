"""`python -m specrt.export`: the export CLI (same as `python export/export.py`)."""

from specrt.export.export import main

raise SystemExit(main())
