"""`python -m warmstart.handlers.cli`: the `warmstart` command."""

import sys

from warmstart.handlers.cli.main import main

sys.exit(main())
