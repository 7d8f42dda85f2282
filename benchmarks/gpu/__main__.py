"""``python -m benchmarks.gpu``: see the package's docstring."""

import sys

from .cli import main

sys.exit(main())
