"""`python -m moelora ...`: the `moelora` command."""

import sys

from moelora.cli import main

sys.exit(main())
