"""`python -m hostir`: the hostir command line (see hostir.cli)."""

import sys

from hostir.cli import main

if __name__ == "__main__":
    sys.exit(main())
