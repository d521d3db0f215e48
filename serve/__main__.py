"""`python -m serve serve --model tiny --port 50051` and `python -m serve client "Hello"`."""

import sys

from serve.cli import main

sys.exit(main())
