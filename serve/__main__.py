"""`python -m serve ...`: the `paged-jax` console script without installing it."""

import sys

from .main import main

sys.exit(main())
