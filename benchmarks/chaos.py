"""The chaos benchmark (R1–R4): the harness is testkit.chaos, which the chaos tests share.

    .venv/bin/python benchmarks/chaos.py [--quick] [--trials N] [--seed S] [--soak]
        [--scenarios R1,R2,R3,R4] [--outage-s S] [--cut-s 5,30] [--json OUT]
"""
from __future__ import annotations

import os
import sys

# The checkout on the path (run as ``python benchmarks/<script>.py``): testkit and the packages.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from testkit.chaos import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
