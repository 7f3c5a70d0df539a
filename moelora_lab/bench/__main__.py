"""``python -m moelora_lab.bench``: see :mod:`moelora_lab.bench.cli`."""
import sys

from .cli import main

sys.exit(main())
