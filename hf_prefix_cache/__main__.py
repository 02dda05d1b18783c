"""``python -m hf_prefix_cache``: the `hf-prefix-cache` command line (see `cli.py`)."""

from __future__ import annotations

import sys

from hf_prefix_cache.frontends.cli import main

sys.exit(main())
