"""``python -m kvcache``: the ``kvcache`` command (:mod:`kvcache.cli`)."""

import sys

from kvcache.cli import main

sys.exit(main())
