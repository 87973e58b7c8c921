"""`python -m zerodp.tools.cli COMMAND ...`: the `zerodp` command."""

import sys

from .main import main

if __name__ == "__main__":
    sys.exit(main())
