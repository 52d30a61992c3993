"""`python -m salus.daemon.cli`: the `salusd` command."""

import sys

from salus.daemon.cli.main import main

sys.exit(main())
