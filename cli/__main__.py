"""`python -m cli`: the `hsx` command."""

import sys

from cli.main import main

sys.exit(main())
