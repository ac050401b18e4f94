"""``python -m mooncake_worker ARGS`` = ``mooncake-operator worker ARGS``."""

import sys

from .cli import main

sys.exit(main())
