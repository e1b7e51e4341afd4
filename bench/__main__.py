"""``python -m bench``: see bench/README.md."""

import sys

from bench.cli import main

sys.exit(main())
