"""Each package's ``__init__`` docstring lists what the package holds, checked on the source.

The convention: one line per module (and per subpackage, and ``__main__``) of the package, as a
list item that starts with the name in double backticks, ``- ``name``: what it holds`` (longer
items go on in indented lines). A module without its line fails, and so does a line that names
a module the package does not hold (one renamed or removed since). The docstrings are parsed,
not imported, so no package's dependencies are loaded.
"""
from __future__ import annotations

import ast
import os
import re

import pytest

pytestmark = pytest.mark.unit

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The project's packages (as in test_import_direction); ``dags`` is Airflow's DAG folder, checked
# only once it is a package.
ROOTS = ("common", "training", "data_checks", "infra", "plugins", "dags")
ITEM = re.compile(r"^- ``([A-Za-z_][A-Za-z0-9_]*)``")


def packages() -> list[str]:
    """Every package folder (one with an ``__init__.py``) under the roots, relative to the repo."""
    found = []
    for root in ROOTS:
        for folder, dirs, files in os.walk(os.path.join(REPO, root)):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            if "__init__.py" in files:
                found.append(os.path.relpath(folder, REPO))
    return sorted(found)


def held(package: str) -> set[str]:
    """The modules and subpackages a package folder holds."""
    folder = os.path.join(REPO, package)
    names = set()
    for entry in os.listdir(folder):
        if entry.endswith(".py") and entry != "__init__.py":
            names.add(entry.removesuffix(".py"))
        elif os.path.isfile(os.path.join(folder, entry, "__init__.py")):
            names.add(entry)
    return names


def items(doc: str) -> list[str]:
    """The names a docstring lists, one per list item, in order."""
    return [m.group(1) for line in doc.splitlines() if (m := ITEM.match(line.strip()))]


def listed(package: str) -> list[str]:
    """The names the package's docstring lists."""
    with open(os.path.join(REPO, package, "__init__.py")) as fh:
        return items(ast.get_docstring(ast.parse(fh.read())) or "")


def test_the_roots_hold_packages() -> None:
    # The check below would pass vacuously if the walk found nothing.
    assert {"common", "common/procs", "training", "training/loop", "infra", "plugins"} <= set(packages())


@pytest.mark.parametrize("package", packages())
def test_package_docstring_lists_every_module_it_holds(package: str) -> None:
    names = listed(package)
    modules = held(package)
    missing = sorted(modules - set(names))
    unknown = sorted(set(names) - modules)
    twice = sorted({n for n in names if names.count(n) > 1})
    problems = [text for found, text in (
        (missing, f"no line for {', '.join(missing)}"),
        (unknown, f"a line for {', '.join(unknown)}, which {package}/ does not hold"),
        (twice, f"more than one line for {', '.join(twice)}"),
    ) if found]
    assert not problems, (f"{package}/__init__.py docstring: {'; '.join(problems)} "
                          f"(one line each: - ``module``: what it holds)")


def test_items_are_list_lines_only() -> None:
    # A name in prose, or further along an item's line, is not one the docstring lists.
    doc = "Holds ``prose``.\n\n- ``a``: with ``b``\n  ``c`` goes on\n- ``d``: and more\n-``e`` unspaced\n"
    assert items(doc) == ["a", "d"]
