"""Run checkov without it calling out: ``python checkov_offline.py ARGS`` (pass ``--skip-download``
too, which stops the Prisma Cloud download). checkov's banner asks PyPI for a newer checkov at
import time through ``update_checker``; that check is stubbed out here, so a lint run touches no
network at all."""
import sys
import warnings

import update_checker

update_checker.UpdateChecker.check = lambda self, *args, **kwargs: None  # type: ignore[method-assign]

from checkov.main import Checkov  # noqa: E402

if __name__ == "__main__":
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", category=SyntaxWarning)
        sys.exit(Checkov().run())
