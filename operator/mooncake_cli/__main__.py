"""``python -m mooncake_cli`` = ``mooncake-operator``."""

from __future__ import annotations

import sys

from mooncake_cli.main import main

sys.exit(main())
