"""`python -m hostir`: the hostir command line (see hostir.cli)."""

import sys

from hostir.cli import main

sys.exit(main())
