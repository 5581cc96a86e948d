"""The constrained-links benchmark: the harness is testkit.constrained_links, which its test shares.

    .venv/bin/python benchmarks/constrained_links.py [--quick] [--rates 200,50,12.5] [--json OUT]
"""
from __future__ import annotations

import os
import sys

# The checkout on the path (run as ``python benchmarks/<script>.py``): testkit and the packages.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from testkit.constrained_links import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
