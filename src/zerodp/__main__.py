"""`python -m zerodp COMMAND ...` (e.g. `torchrun --nproc_per_node 2 -m zerodp train`): the `zerodp` command."""

import sys

from .tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
