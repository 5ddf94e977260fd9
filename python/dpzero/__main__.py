"""``python -m dpzero`` is the ``dpzero`` command."""

import sys

from .cli import main

sys.exit(main())
