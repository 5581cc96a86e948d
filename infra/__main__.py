"""``python -m infra`` is ``python -m infra.services``."""
import sys

from infra.services import main

sys.exit(main())
