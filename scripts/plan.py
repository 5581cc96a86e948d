"""Hardware planning for a model of the zoo by name: ``infra.planning``'s CLI with ``--model``.

    .venv/bin/python scripts/plan.py --model resnet50 --input-shape 3,224,224 --classes 1000 \\
        --batch-size 256 --optimizer sgd --momentum 0.9 --precision fp32

The planner (infra) takes a model as counts and must not import the trainer; counting a network
by name needs the trainer's model zoo (``training.loop.model.count_model``, mxnet shape inference).
This entry point sits above both and joins them; every flag and the exit code (1 when nothing
fits) are ``python -m infra.planning``'s.
"""
from __future__ import annotations

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from infra.planning import main  # noqa: E402
from training.loop.model import count_model  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(count_model=count_model, prog="scripts/plan.py"))
