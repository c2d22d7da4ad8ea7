"""``python -m nbtorch.gradcheck_report``: runs :mod:`nbtorch.tools.gradcheck_report` (its home since the tools left the library)."""

import sys

from nbtorch.tools.gradcheck_report import main

if __name__ == "__main__":
    sys.exit(main())
