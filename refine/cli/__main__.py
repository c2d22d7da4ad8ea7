"""``python -m refine.cli``: the ``nbtorch-refine`` command."""

import sys

from refine.cli.main import main

sys.exit(main())
