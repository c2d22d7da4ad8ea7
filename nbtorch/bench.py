"""``python -m nbtorch.bench``: runs :mod:`nbtorch.tools.bench` (its home since the tools left the library)."""

import sys

from nbtorch.tools.bench import main

if __name__ == "__main__":
    sys.exit(main())
