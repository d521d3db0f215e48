"""`python -m paged_jax_cli ...`: the `paged-jax` console script without installing it."""

import sys

from paged_jax_cli import main

sys.exit(main())
