"""`python -m handlers.cli`: the `warmstart` command."""

import sys

from handlers.cli.main import main

sys.exit(main())
