"""``python -m nbtorch``: the nanoBragg-compatible command line."""

import sys

from nbtorch.cli.main import main

sys.exit(main())
