"""common.settings is the one place the project reads its environment: a walk over the code that
finds any other read, the table of variables in docs/environment.md against the class, and a bad value's
error."""
from __future__ import annotations

import ast

import pytest
from pydantic import ValidationError

from common.settings import env_table, settings
from testkit import ROOT as REPO
from training.tracking.server import tracking_uri as mlflow_tracking_uri

pytestmark = pytest.mark.unit

# The project's code; tests and benchmarks set up environments for what they run.
CODE_DIRS = ("common", "training", "data_checks", "infra", "plugins", "dags", "scripts")
SETTINGS_FILE = "common/settings.py"
# (file, function) pairs whose read of os.environ is not configuration, each with its reason.
ALLOWED = {
    # A snapshot of variables set for MLflow around a call, put back as found when it ends;
    # nothing in it is interpreted.
    ("training/tracking/runs.py", "environ_restored"),
}


def _is_environ(node: ast.AST) -> bool:
    """``os.environ``, or ``environ`` imported from os."""
    if isinstance(node, ast.Attribute):
        return node.attr == "environ" and isinstance(node.value, ast.Name) and node.value.id == "os"
    return isinstance(node, ast.Name) and node.id == "environ"


def _is_getenv(node: ast.AST) -> bool:
    if isinstance(node, ast.Attribute):
        return node.attr in ("getenv", "getenvb") and isinstance(node.value, ast.Name) and node.value.id == "os"
    return isinstance(node, ast.Name) and node.id == "getenv"


class _EnvReads(ast.NodeVisitor):
    """Reads of one variable: ``environ.get(...)``, ``getenv(...)``, ``environ[...]`` as a value.

    Passing the whole environment on (``dict(os.environ)``, ``{**os.environ}``, ``.copy()``,
    ``.items()``) and writes (``environ[k] = v``, ``.update``, ``.pop``, ``.setdefault``) are not
    reads of configuration.
    """

    def __init__(self, path: str, source: str) -> None:
        self.path, self.source = path, source
        self.scope: list[str] = []
        self.hits: list[str] = []

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if _is_getenv(func) or (isinstance(func, ast.Attribute) and func.attr == "get" and _is_environ(func.value)):
            self._hit(node)
        self.generic_visit(node)

    def visit_Subscript(self, node: ast.Subscript) -> None:
        if _is_environ(node.value) and isinstance(node.ctx, ast.Load):
            self._hit(node)
        self.generic_visit(node)

    def _hit(self, node: ast.AST) -> None:
        function = self.scope[-1] if self.scope else "<module>"
        if (self.path, function) not in ALLOWED:
            self.hits.append(f"{self.path}:{node.lineno} ({function}): {ast.get_source_segment(self.source, node)}")


def env_reads(path: str, source: str) -> list[str]:
    walker = _EnvReads(path, source)
    walker.visit(ast.parse(source, filename=path))
    return walker.hits


@pytest.mark.parametrize("code,reads", [
    ("import os\nx = os.environ.get('A')", 1),
    ("import os\nx = os.getenv('A', '1')", 1),
    ("import os\nx = os.environ['A']", 1),
    ("from os import environ, getenv\nx = environ.get('A') or getenv('B') or environ['C']", 3),
    ("import os\ndef f():\n    return int(os.environ.get('A', '1'))", 1),
    ("import os\nenv = {**os.environ, 'A': '1'}\nbase = dict(os.environ)\ncopy = os.environ.copy()", 0),
    ("import os\nos.environ['A'] = '1'\nos.environ.update(B='2')\nos.environ.pop('C', None)\n"
     "del os.environ['D']\nos.environ.setdefault('E', '5')", 0),
    ("import os\nkept = {k: v for k, v in os.environ.items() if k != 'A'}", 0),
])
def test_the_walk_tells_reads_from_pass_through_and_writes(code, reads):
    assert len(env_reads("x.py", code)) == reads


def test_no_environment_read_outside_settings():
    hits = []
    for folder in CODE_DIRS:
        for path in sorted((REPO / folder).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            if rel != SETTINGS_FILE:
                hits += env_reads(rel, path.read_text())
    assert not hits, ("read these through common.settings (a field of Settings, settings().field):\n  "
                      + "\n  ".join(hits))


def test_the_environment_page_holds_the_settings_table():
    page = (REPO / "docs" / "environment.md").read_text()
    assert env_table() in page, "docs/environment.md is stale: run .venv/bin/python scripts/gen_docs.py"


def test_a_bad_value_fails_naming_the_variable(monkeypatch):
    monkeypatch.setenv("MXPIPE_MAX_ACTIVE_RUNS", "x")
    with pytest.raises(ValidationError, match="MXPIPE_MAX_ACTIVE_RUNS"):
        settings()
    with pytest.raises(ValidationError, match="MXPIPE_FAULT_KILL_STEP"):
        settings({"MXPIPE_FAULT_KILL_STEP": "soon"})


def test_a_given_environment_is_read_alone(monkeypatch):
    monkeypatch.setenv("MXPIPE_EVENTS_FILE", "/from/this/process")
    assert settings().events_file == "/from/this/process"
    assert settings({"MXPIPE_EVENTS_FILE": "/given"}).events_file == "/given"
    assert settings({}).events_file is None and settings({}).max_active_runs == 1


def test_mlflow_tracking_uri_is_the_variable_else_mlflows_own(monkeypatch):
    import mlflow

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9/tracking")
    assert mlflow_tracking_uri() == "http://127.0.0.1:9/tracking"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "")
    assert mlflow_tracking_uri() == mlflow.get_tracking_uri()
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    assert mlflow_tracking_uri() == mlflow.get_tracking_uri()
