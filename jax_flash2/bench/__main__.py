"""``python -m jax_flash2.bench``: the same as the ``jax-flash2-bench`` script."""

import sys

from jax_flash2.bench.cli import main

sys.exit(main())
