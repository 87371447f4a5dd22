"""`python -m loadgen --help`."""

from loadgen.cli import main

raise SystemExit(main())
