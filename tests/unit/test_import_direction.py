"""The import direction, checked on the source: dags → plugins → training / data_checks / infra → common.

Every ``.py`` file of the six packages is parsed (not imported) and every import in it is an
edge: module level, inside functions, under ``if TYPE_CHECKING``, and ``importlib.import_module``
/ ``__import__`` calls with a string literal. An edge the rules below do not allow fails the
test with ``file:line: importer → imported``. The rules are the ones docs/architecture.md
("Layers and import direction") and each package's docstring state.

``tests/``, ``benchmarks/``, ``scripts/`` and ``testkit/`` sit above everything: no package
imports them, they may import every package. Among themselves (``test_the_checkout_folders_*``):
what tests and benchmarks share is in ``testkit/``, which imports neither of them; tests never
import benchmarks (but for the tests of a benchmark's own code, ``BENCHMARK_TESTS``), and
benchmarks never import tests. A bare import of a module that lives in one of these folders
(``sys.path`` set to the folder) counts as an import of that folder.
"""
from __future__ import annotations

import ast
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest

from testkit import REPO

pytestmark = pytest.mark.unit

PACKAGES = ("dags", "plugins", "training", "data_checks", "infra", "common")
# Project code that no package may import (it may import the packages).
ABOVE = ("tests", "benchmarks", "scripts", "testkit")
PROJECT = PACKAGES + ABOVE

# Which other packages each one may import (every package may import its own modules).
LAYERS: dict[str, frozenset[str]] = {
    "common": frozenset(),
    "training": frozenset({"common"}),
    "data_checks": frozenset({"common"}),
    "infra": frozenset({"common"}),
    "plugins": frozenset({"training", "data_checks", "infra", "common"}),
    "dags": frozenset({"plugins", "common"}),
}
# Packages whose code runs without Airflow (a shell, a role process): they never import it.
NO_AIRFLOW = frozenset({"common", "training", "data_checks", "infra"})

# What each subpackage of training/ may import of training/, from its __init__ docstring (a
# prefix: "training.launch.job" allows that module only). Its own modules are always allowed.
TRAINING_SUBPACKAGES: dict[str, frozenset[str]] = {
    "feed": frozenset(),
    "checkpoint": frozenset(),
    "launch": frozenset(),
    # The job spec and exit codes are the contract between a role and its supervisor; the
    # supervisor itself (training.launch.launcher) is not a role's business.
    "loop": frozenset({"training.feed", "training.checkpoint", "training.launch.job"}),
    "tracking": frozenset({"training.feed", "training.checkpoint"}),
}
# Files MLflow executes on their own (logged as code): nothing of the project at all.
SELF_CONTAINED = frozenset({"training/tracking/pyfunc_model.py"})


@dataclass(frozen=True)
class Edge:
    path: str  # relative to the repository, with "/"
    line: int
    importer: str  # dotted module name of the file
    imported: str  # dotted name as written (for "from a import b": "a.b")


def module_name(path: str) -> str:
    parts = path[:-3].split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(importer: str, is_package: bool, level: int, module: str | None) -> str:
    """The absolute name of a relative import (``from ..x import y`` in ``a.b.c``)."""
    base = importer.split(".")
    base = base if is_package else base[:-1]
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _literal_import(node: ast.Call) -> str | None:
    """The module of ``importlib.import_module("x")`` / ``import_module("x")`` / ``__import__("x")``."""
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    if name not in ("import_module", "__import__") or not node.args:
        return None
    arg = node.args[0]
    return arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else None


def edges(path: str, source: str) -> Iterator[Edge]:
    """Every import in ``source`` (the file at ``path``), wherever it appears."""
    importer = module_name(path)
    is_package = path.endswith("/__init__.py")
    for node in ast.walk(ast.parse(source, filename=path)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Edge(path, node.lineno, importer, alias.name)
        elif isinstance(node, ast.ImportFrom):
            module = (_resolve(importer, is_package, node.level, node.module) if node.level
                      else node.module or "")
            for alias in node.names:
                # "from training.feed import data" imports the module training.feed.data;
                # "from common.config import TrainConfig" is judged by its module, the same.
                yield Edge(path, node.lineno, importer, f"{module}.{alias.name}" if alias.name != "*" else module)
        elif isinstance(node, ast.Call) and (literal := _literal_import(node)):
            yield Edge(path, node.lineno, importer, literal)


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def problem(edge: Edge) -> str | None:
    """Why ``edge`` is forbidden, or None."""
    src, dst = edge.importer.split("."), edge.imported.split(".")
    if dst[0] == "airflow" and src[0] in NO_AIRFLOW:
        return f"{src[0]} runs without Airflow and never imports it"
    if dst[0] not in PROJECT or (dst[0] == src[0] and src[0] != "training"):
        return None  # not the project's, or within one package (training's parts have rules)
    if edge.path in SELF_CONTAINED:
        return "this file is executed by MLflow on its own and imports nothing of the project"
    if dst[0] in ABOVE:
        return f"{dst[0]}/ sits above every package; nothing imports it"
    if dst[0] != src[0]:
        if dst[0] in LAYERS[src[0]]:
            return None
        allowed = ", ".join(sorted(LAYERS[src[0]])) or "no other package"
        return f"{src[0]} may import {allowed}"
    return _training_problem(src, edge.imported)


def _training_problem(src: list[str], imported: str) -> str | None:
    """Rules between training's subpackages; training's own top-level modules (the CLI) may
    import any of them, and the bare package ``training`` is always fine."""
    own = src[1] if len(src) > 2 or (len(src) == 2 and src[1] in TRAINING_SUBPACKAGES) else None
    dst = imported.split(".")
    if own is None or len(dst) == 1 or dst[1] == own:
        return None
    if own not in TRAINING_SUBPACKAGES:
        return f"training.{own} has no import rule yet (TRAINING_SUBPACKAGES)"
    if any(_within(imported, allowed) for allowed in TRAINING_SUBPACKAGES[own]):
        return None
    allowed = ", ".join(sorted(TRAINING_SUBPACKAGES[own])) or "no other part of training"
    return f"training.{own} may import common and {allowed} (training/{own}/__init__.py)"


def python_files(folders: tuple[str, ...]) -> list[str]:
    """Every ``.py`` file under ``folders``, relative to the repository, with "/"."""
    out = []
    for folder in folders:
        for root, dirs, files in os.walk(os.path.join(REPO, folder)):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            out += [os.path.relpath(os.path.join(root, f), REPO).replace(os.sep, "/")
                    for f in sorted(files) if f.endswith(".py")]
    return out


def project_files() -> list[str]:
    return python_files(PACKAGES)


def violations(files: list[str], judge: Callable[[Edge], str | None] = problem) -> list[str]:
    """``file:line: importer → imported: why`` of every edge of ``files`` that ``judge`` forbids."""
    found = []
    for path in files:
        with open(os.path.join(REPO, path), encoding="utf-8") as fh:
            source = fh.read()
        for edge in edges(path, source):
            if (why := judge(edge)) is not None:
                found.append(f"{edge.path}:{edge.line}: {edge.importer} → {edge.imported}: {why}")
    return found


def test_every_import_points_down_the_layers():
    files = project_files()
    assert {f.split("/")[0] for f in files} == set(PACKAGES), "a package has no Python files: wrong REPO?"
    found = violations(files)
    assert not found, "imports against the import direction (docs/architecture.md):\n" + "\n".join(found)


def test_every_training_subpackage_has_rules():
    present = {d for d in os.listdir(os.path.join(REPO, "training"))
               if os.path.isfile(os.path.join(REPO, "training", d, "__init__.py"))}
    assert present == set(TRAINING_SUBPACKAGES), (
        "training/'s subpackages changed: state what a new one may import in its docstring and "
        "in TRAINING_SUBPACKAGES here")


@pytest.mark.parametrize("path, source, line, imported", [
    ("common/x.py", "def f():\n    from training.loop import worker\n", 2, "training.loop.worker"),
    ("infra/x.py", "import importlib\nm = importlib.import_module('training.loop.model')\n", 2, "training.loop.model"),
    ("data_checks/x.py", "if True:\n    import training.feed.data\n", 2, "training.feed.data"),
    ("dags/x.py", "from infra import cluster\n", 1, "infra.cluster"),
    ("plugins/x.py", "__import__('dags.mxnet_training')\n", 1, "dags.mxnet_training"),
    ("training/x.py", "from airflow.sdk import task\n", 1, "airflow.sdk.task"),
    ("training/tracking/x.py", "from ..loop import worker\n", 1, "training.loop.worker"),
    ("training/loop/x.py", "from training.launch.launcher import Supervisor\n", 1,
     "training.launch.launcher.Supervisor"),
    ("training/feed/x.py", "from training.checkpoint import store\n", 1, "training.checkpoint.store"),
    ("training/tracking/pyfunc_model.py", "from common import storage\n", 1, "common.storage"),
    ("common/x.py", "from tests.conftest import s3\n", 1, "tests.conftest.s3"),
])
def test_the_walk_finds_a_forbidden_edge_wherever_it_is(path, source, line, imported):
    assert [(e.line, e.imported) for e in edges(path, source) if problem(e)] == [(line, imported)]


@pytest.mark.parametrize("path, source", [
    ("training/loop/x.py", "from training.launch.job import JobSpec\nfrom training.feed import prefetch\n"),
    ("training/tracking/x.py", "from training.checkpoint.store import store_for\nfrom . import registry\n"),
    ("training/__main__.py", "from training.launch.launcher import Supervisor\nfrom training.loop.worker import run\n"),
    ("plugins/x.py", "from infra.cluster import attach\nfrom training.launch.job import JobSpec\n"),
    ("dags/x.py", "from plugins import pipeline_tasks\nfrom common.config import MODELS\nimport airflow.sdk\n"),
    ("infra/x.py", "if TYPE_CHECKING:\n    from common.roles import JobLaunch\n"),
])
def test_the_walk_allows_what_the_rules_allow(path, source):
    assert [e for e in edges(path, source) if problem(e)] == []


PACKAGES_WITH_INIT = ("plugins", "training", "data_checks", "infra", "common",
                      *(f"training/{sub}" for sub in TRAINING_SUBPACKAGES))


@pytest.mark.parametrize("package", PACKAGES_WITH_INIT)
def test_every_package_says_what_it_is(package):
    path = os.path.join(REPO, package, "__init__.py")
    with open(path, encoding="utf-8") as fh:
        doc = ast.get_docstring(ast.parse(fh.read()))
    assert doc and doc.strip(), f"{package}/__init__.py has no module docstring"


# --- the checkout folders among themselves -----------------------------------------------------

# What each checkout folder must not import (every package, and testkit, it may).
CHECKOUT_FORBIDDEN: dict[str, frozenset[str]] = {
    "tests": frozenset({"benchmarks"}),
    "benchmarks": frozenset({"tests"}),
    "testkit": frozenset({"tests", "benchmarks"}),
    "scripts": frozenset({"tests", "benchmarks", "testkit"}),
}
# Tests of a benchmark script's own code (the report's table, the goodput comparison's statistics) import
# that benchmark: the one exception to "tests never import benchmarks". Helpers both use go in
# testkit/ instead.
BENCHMARK_TESTS: dict[str, frozenset[str]] = {
    "tests/unit/test_benchmark_report.py": frozenset({"benchmarks.run"}),
    "tests/unit/test_goodput.py": frozenset({"benchmarks.goodput"}),
    "tests/unit/test_big_model_bench.py": frozenset({"benchmarks.big_model"}),
}


def bare_modules(files: list[str]) -> dict[str, str]:
    """Module name → dotted path of every module file of the checkout folders, for bare imports
    (``from netns_hosts import x`` with the file's folder put on ``sys.path``)."""
    return {path.rsplit("/", 1)[-1][:-3]: module_name(path) for path in files
            if not path.endswith("/__init__.py")}


def checkout_problem(edge: Edge, bare: dict[str, str]) -> str | None:
    """Why ``edge`` (from a checkout folder) is forbidden, or None."""
    head = edge.imported.split(".")[0]
    imported = bare[head] + edge.imported[len(head):] if head in bare else edge.imported
    src, dst = edge.importer.split(".")[0], imported.split(".")[0]
    if dst not in CHECKOUT_FORBIDDEN[src]:
        return None
    if any(_within(imported, allowed) for allowed in BENCHMARK_TESTS.get(edge.path, ())):
        return None
    return f"{src}/ never imports {dst}/ (what both use goes in testkit/)"


def test_the_checkout_folders_import_through_testkit_only():
    files = python_files(tuple(CHECKOUT_FORBIDDEN))
    assert {f.split("/")[0] for f in files} == set(CHECKOUT_FORBIDDEN), "a checkout folder has no Python files"
    bare = bare_modules(files)
    found = violations(files, lambda edge: checkout_problem(edge, bare))
    assert not found, "imports between tests/, benchmarks/, scripts/ and testkit/:\n" + "\n".join(found)


BARE = {"netns_hosts": "tests.integration.netns_hosts", "chaos": "benchmarks.chaos"}


@pytest.mark.parametrize("path, source, imported", [
    ("tests/unit/test_x.py", "from benchmarks.soak_killer import Killer\n", "benchmarks.soak_killer.Killer"),
    ("tests/unit/test_goodput.py", "from benchmarks.chaos import base_config\n", "benchmarks.chaos.base_config"),
    ("benchmarks/x.py", "def f():\n    from tests.integration.local_jobs import run_local\n",
     "tests.integration.local_jobs.run_local"),
    ("benchmarks/x.py", "from netns_hosts import namespace_hosts\n", "netns_hosts.namespace_hosts"),
    ("testkit/x.py", "import benchmarks.chaos\n", "benchmarks.chaos"),
    ("testkit/x.py", "import chaos\n", "chaos"),
    ("testkit/x.py", "from tests.conftest import S3Server\n", "tests.conftest.S3Server"),
    ("scripts/x.py", "from testkit import REPO\n", "testkit.REPO"),
])
def test_the_checkout_walk_finds_a_forbidden_edge(path, source, imported):
    assert [e.imported for e in edges(path, source) if checkout_problem(e, BARE)] == [imported]


@pytest.mark.parametrize("path, source", [
    ("tests/unit/test_goodput.py", "from testkit.timeline import goodput\nfrom testkit.killer import Killer\n"),
    ("benchmarks/x.py", "from testkit.local_jobs import run_local\nfrom benchmarks import chaos\nimport chaos\n"),
    ("testkit/x.py", "from testkit import REPO\nfrom training.launch.job import JobSpec\n"),
    ("tests/integration/x.py", "import netns_hosts\nfrom tests.integration import tiny_model\n"),
])
def test_the_checkout_walk_allows_what_the_rules_allow(path, source):
    assert [e for e in edges(path, source) if checkout_problem(e, BARE)] == []
