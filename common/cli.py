"""What the project's command lines share: help with examples, and bad input as one line.

Exit status 2 is argparse's for a usage error, and every command line here keeps to it: a
missing config file, a config that does not validate or an argument out of range prints one
line, ``error: <what>``, on stderr. A job that ran and failed keeps its own exit codes, and an
unexpected exception keeps its traceback: that is a bug to fix, not input to correct.
"""
from __future__ import annotations

import argparse
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager

USAGE_ERROR = 2


def parser(description: str, examples: str, prog: str | None = None) -> argparse.ArgumentParser:
    """An ArgumentParser whose ``--help`` ends with ``examples``, kept as written (line breaks, indents)."""
    return argparse.ArgumentParser(prog=prog, description=textwrap.fill(description, 88),
                                   epilog="examples:\n" + textwrap.indent(textwrap.dedent(examples).strip(), "  "),
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


@contextmanager
def usage_errors(*kinds: type[Exception]) -> Iterator[None]:
    """Turn an exception of ``kinds`` raised inside into one line on stderr and exit status 2."""
    try:
        yield
    except kinds as exc:
        print("error: " + " ".join(str(exc).split()), file=sys.stderr)
        raise SystemExit(USAGE_ERROR) from None
