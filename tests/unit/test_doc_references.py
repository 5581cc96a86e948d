"""The docs name only what exists: every module, class, function, file and config field that
README.md or a page of docs/ names in backticks is found in the repository.

Names are resolved by parsing the source (``ast``), never by importing it: a dotted name
(``plugins.training_dag.training_dag``, ``infra.cluster:attach``) as a module path and then
attributes of it; ``Class.attr`` through every project class of that name (and its project
bases); a path (``training/loop/worker.py``, ``tests/unit/test_shard.py::test_x``) as a file and,
after ``::``, a test in it; ``python -m pkg`` as a module; ``section.field`` as a field of
``TrainConfig``; ``MXPIPE_*`` as a variable of ``common.settings.Settings`` or one the code sets;
a Markdown link to a file of the repository as that file, and its ``#anchor`` as a heading in it.
What cannot be told from prose (a lowercase word, a third-party name such as ``mlflow.pyfunc``, a
path under a run's prefix) is left alone. A failure lists ``file:line`` and why, per reference.
"""
from __future__ import annotations

import ast
import builtins
import fnmatch
import functools
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
DOCS = ("README.md", "docs/*.md")
# Top-level folders of Python code: a dotted name starting with one of them is a module path.
PY_ROOTS = ("common", "training", "data_checks", "infra", "plugins", "dags", "tests", "benchmarks", "scripts")
CONFIG_SECTIONS = {"data": "DataConfig", "model": "ModelConfig", "optim": "OptimConfig",
                   "cluster": "ClusterConfig", "checkpoint": "CheckpointConfig", "sweep": "SweepConfig"}
_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_DOTTED = re.compile(rf"{_IDENT}(?:[.:]{_IDENT})+")
_CALL = re.compile(rf"({_IDENT}(?:[.:]{_IDENT})*)\(.*\)")
_ASSIGN = re.compile(rf"({_IDENT}(?:\.{_IDENT})*)\s*=.*")
_MODULE_FLAG = re.compile(rf"python -m ({_IDENT}(?:\.{_IDENT})*)")
# Names of other software the docs mention that the code never spells out: MXNet's engine and
# ps-lite internals, OpenSSH options, AWS API fields, HTTP headers, kernel options.
EXTERNAL_NAMES = frozenset({
    "NaiveEngine", "CustomOp", "Custom", "Init", "Pull", "PushPull", "PushPullDefault", "Reduce",
    "IdentitiesOnly", "GetCommandInvocation", "StandardOutputContent", "StrictHostKeyChecking", "ArtifactPrefix", "ClientToken", "Success", "DurationSeconds",
    "ETag", "CONFIG_NET_SCH_NETEM", "_allreduce_grads",
})
# Characters of a placeholder or a runtime location, not a file of the repository.
_PLACEHOLDER = set("$<>{}*…[]")


@dataclass
class ClassInfo:
    members: set[str] = field(default_factory=set)
    bases: list[str] = field(default_factory=list)


@dataclass
class Index:
    """What the repository's Python defines, by module and by class, and every identifier and
    string it uses (a third-party name the docs mention is one the code uses)."""

    modules: dict[str, set[str]] = field(default_factory=dict)  # dotted module → top-level names
    classes: dict[str, list[ClassInfo]] = field(default_factory=dict)
    used: set[str] = field(default_factory=set)
    strings: set[str] = field(default_factory=set)  # the words of its string constants
    literals: set[str] = field(default_factory=set)  # its short string constants, whole


def _module_name(rel: Path) -> str:
    parts = list(rel.with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _targets(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, (ast.Tuple, ast.List)):
        return [n for elt in node.elts for n in _targets(elt)]
    return []


def _defined(body: list[ast.stmt]) -> set[str]:
    """Names a module or class body binds: defs, classes, assignments, imports (also inside if/try)."""
    names: set[str] = set()
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(n for t in node.targets for n in _targets(t))
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            names.update(_targets(node.target))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            names |= _defined(node.body + getattr(node, "orelse", []) + getattr(node, "finalbody", [])
                              + [s for h in getattr(node, "handlers", []) for s in h.body])
    return names


def _class_info(node: ast.ClassDef) -> ClassInfo:
    info = ClassInfo(members=_defined(node.body), bases=[ast.unparse(b).split("[")[0] for b in node.bases])
    for item in ast.walk(node):  # instance attributes: self.x = ... in its methods
        if isinstance(item, (ast.Assign, ast.AnnAssign)):
            for target in item.targets if isinstance(item, ast.Assign) else [item.target]:
                if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
                    info.members.add(target.attr)
    return info


@functools.cache
def index() -> Index:
    idx = Index()
    for root in PY_ROOTS:
        for path in sorted((REPO / root).rglob("*.py")):
            rel = path.relative_to(REPO)
            if path == Path(__file__).resolve():  # its examples of missing names are not code
                continue
            tree = ast.parse(path.read_text(), filename=str(rel))
            idx.modules[_module_name(rel)] = _defined(tree.body)
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    idx.classes.setdefault(node.name, []).append(_class_info(node))
                    idx.used.add(node.name)
                elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    idx.used.add(node.name)
                elif isinstance(node, ast.Name):
                    idx.used.add(node.id)
                elif isinstance(node, ast.Attribute):
                    idx.used.add(node.attr)
                elif isinstance(node, ast.alias):
                    idx.used.update((node.asname or node.name).split(".") + node.name.split("."))
                elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                    if len(node.value) < 80:
                        idx.literals.add(node.value)
                    idx.strings.update(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", node.value))
    return idx


def _class_has(name: str, attr: str, seen: frozenset[str] = frozenset()) -> bool:
    """Whether a project class ``name`` (any of that name) has ``attr``, itself or through its
    project bases. A third-party base (pydantic's ``BaseModel``, Airflow's ``BaseOperator``) is
    not parsed: an attribute the code uses somewhere counts as one it may provide."""
    for info in index().classes.get(name, []):
        if attr in info.members:
            return True
        for base in (b.rsplit(".", 1)[-1] for b in info.bases):
            if base in index().classes:
                if base not in seen and _class_has(base, attr, seen | {name}):
                    return True
            elif base not in ("object", "Protocol", "Generic") and attr in index().used:
                return True
    return False


def _resolve_module_path(parts: list[str]) -> str | None:
    """Why the dotted project name ``parts`` does not resolve, or None when it does."""
    idx = index()
    for cut in range(len(parts), 0, -1):
        module = ".".join(parts[:cut])
        if module in idx.modules:
            break
    else:
        return f"no module {parts[0]}"
    rest, owner = parts[cut:], module
    if not rest:
        return None
    names = idx.modules[module]
    attr = rest[0]
    if attr not in names:
        return f"{module} defines no {attr}"
    if len(rest) == 1:
        return None
    if attr in idx.classes:
        return _resolve_attrs(attr, rest[1:])
    return f"{owner}.{attr} is not a class of the project, so {'.'.join(rest[1:])} cannot be checked in it"


def _resolve_attrs(cls: str, attrs: list[str]) -> str | None:
    for attr in attrs:
        if not _class_has(cls, attr):
            return f"class {cls} has no {attr}"
        if attr not in index().classes:
            return None  # a method or value: what follows is its own business
        cls = attr
    return None


def _config_field(section: str, name: str) -> str | None:
    # ``model.epoch_exported`` is an MLflow tag, which the code writes as that string.
    if _class_has(CONFIG_SECTIONS[section], name) or f"{section}.{name}" in index().literals:
        return None
    return f"the config section {section} has no field {name} (nor does the code write it as a string)"


def _env_var(name: str) -> str | None:
    from common.settings import Settings

    declared = {(f.json_schema_extra or {})["env"] for f in Settings.model_fields.values()}
    if name in declared or name in index().strings:
        return None
    return f"{name} is neither a field of common.settings.Settings nor set anywhere in the code"


@functools.cache
def _ignored() -> tuple[str, ...]:
    """The repository's .gitignore patterns: files a user creates (``docker/.env``), not the repo's."""
    lines = (REPO / ".gitignore").read_text().splitlines()
    return tuple(line.strip() for line in lines if line.strip() and not line.startswith("#"))


def _path(token: str) -> str | None:
    path, _, test = token.removeprefix("./").partition("::")
    if any(fnmatch.fnmatch(path, pattern) for pattern in _ignored()):
        return None
    if not (REPO / path).exists():
        module_file, _, attr = path.rpartition(".")  # training/loop/kvstore_sync.make_trainer
        if module_file and (REPO / f"{module_file}.py").is_file() and re.fullmatch(_IDENT, attr):
            return _resolve_module_path([*module_file.split("/"), attr])
        return f"no file or folder {path}"
    if test:
        tree = ast.parse((REPO / path).read_text())
        names = _defined(tree.body) | {n for c in ast.walk(tree) if isinstance(c, ast.ClassDef)
                                       for n in _defined(c.body)}
        missing = [part for part in test.split("::") if part.split("[")[0] not in names]
        if missing:
            return f"{path} has no {missing[0]}"
    return None


def _is_repo_path(token: str) -> bool:
    token = token.removeprefix("./")
    first = token.split("/", 1)[0]
    return ("/" in token and "://" not in token and not (_PLACEHOLDER & set(token))
            and first != "" and not first.startswith(".") and (REPO / first).is_dir())


def check_span(span: str) -> list[str]:
    """Why the backticked text ``span`` names something that does not exist (empty: it does,
    or it is nothing this check can tell)."""
    span = span.strip().rstrip(".,;:")
    problems = [why for module in _MODULE_FLAG.findall(span) if module.split(".")[0] in PY_ROOTS
                for why in [_resolve_module_path(module.split("."))] if why]
    if any(c.isspace() for c in span):
        tokens = (token.rstrip(".,;:") for token in span.split())
        return problems + [why for token in tokens if _is_repo_path(token) for why in [_path(token)] if why]
    if _is_repo_path(span):
        return [why for why in [_path(span)] if why]
    for pattern in (_CALL, _ASSIGN):
        matched = pattern.fullmatch(span)
        if matched:
            span = matched.group(1)
            called = pattern is _CALL
            break
    else:
        called = False
    if not re.fullmatch(rf"{_IDENT}(?:[.:]{_IDENT})*", span):
        return []
    parts = re.split(r"[.:]", span)
    head = parts[0]
    why: str | None = None
    if len(parts) > 1 and head in PY_ROOTS:
        why = _resolve_module_path(parts)
    elif len(parts) == 2 and head in CONFIG_SECTIONS:
        why = _config_field(head, parts[1])
    elif head.startswith("MXPIPE_") and len(parts) == 1:
        why = _env_var(head)
    elif head in EXTERNAL_NAMES or head in dir(builtins):
        pass
    elif head[0].isupper() and not head.isupper():  # CamelCase: a class, then its attributes
        if head in index().classes:
            why = _resolve_attrs(head, parts[1:])
        elif head not in index().used:
            why = f"{head} is neither defined nor used anywhere in the code (a third-party name: EXTERNAL_NAMES)"
    elif head.isupper() and "_" in head.strip("_") and len(parts) == 1:  # a constant, or a variable
        if head not in index().used and head not in index().strings:
            why = f"{head} is neither defined nor used anywhere in the code (a third-party name: EXTERNAL_NAMES)"
    elif len(parts) == 1 and called and "_" in head and head not in index().used:
        why = f"no function {head} anywhere in the code"
    elif len(parts) == 1 and re.fullmatch(r"_?[a-z][a-z0-9]*(_[a-z0-9]+)+", head):
        # A snake_case name: a function, a field, a metric or a key, which the code spells somewhere.
        if head not in index().used and head not in index().strings:
            why = f"{head} is neither defined, used nor written anywhere in the code"
    return [why] if why else []


def doc_files() -> list[Path]:
    return sorted({p for pattern in DOCS for p in REPO.glob(pattern)})


def bad_references(path: Path) -> list[str]:
    """``file:line: `span`: why`` for each reference of one Markdown file that does not resolve."""
    found, fenced = [], False
    rel = path.relative_to(REPO).as_posix() if path.is_relative_to(REPO) else path.name
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        # In a code block, commands: the files and modules they run; in prose, the code spans
        # and the links to other files of the repository.
        spans = [line] if fenced else re.findall(r"`([^`]+)`", line)
        for span in spans:
            found += [f"{rel}:{number}: `{span.strip()}`: {why}" for why in check_span(span)]
        for target in ([] if fenced else re.findall(r"\]\(([^)\s]+)\)", line)):
            why = _link(path, target)
            if why:
                found.append(f"{rel}:{number}: link ({target}): {why}")
    return found


def _anchors(page: Path) -> set[str]:
    """The anchors of a Markdown page's headings, as GitHub makes them: lowercase, punctuation
    dropped, spaces as hyphens."""
    anchors, fenced = set(), False
    for line in page.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


def _link(page: Path, target: str) -> str | None:
    """Why a link of ``page`` to a file of the repository (and a heading in it) goes nowhere."""
    local, _, anchor = target.partition("#")
    if "://" in local or local.startswith("mailto:"):
        return None
    linked = (page.parent / local).resolve() if local else page
    if not linked.exists():
        return f"no file {local} beside {page.name}"
    if anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
        return f"{linked.name} has no heading #{anchor}"
    return None


@pytest.mark.parametrize("span,ok", [
    ("plugins.training_dag.training_dag", True),
    ("plugins.training_dag.no_such_function", False),
    ("infra.cluster:attach", True),
    ("common.procs.Watch", True),
    ("training/loop/worker.py", True),
    ("training/loop/no_such_module.py", False),
    ("tests/unit/test_shard.py::test_memory_follows_the_chunk_not_the_dataset", True),
    ("tests/unit/test_shard.py::test_that_is_not_there", False),
    ("python -m infra.services up", True),
    ("python -m infra.no_such_module", False),
    ("TrainConfig.digest_dict", True),
    ("TrainConfig.no_such_method", False),
    ("checkpoint.upload_timeout_s", True),
    ("checkpoint.no_such_field=3", False),
    ("MXPIPE_TRAIN_POLL_S", True),
    ("MXPIPE_NO_SUCH_VARIABLE", False),
    ("NoSuchClassAnywhere", False),
    ("_no_such_helper()", False),
    ("track_best", True),
    ("no_such_helper", False),
    # Not the repository's, or not a name at all: left alone.
    ("mlflow.models.evaluate", True),
    ("s3://mxpipe/runs/{dag_id}", True),
    ("$MXPIPE_HOME/jobs/<cluster>/<job_id>.log", True),
    ("train", True),
])
def test_the_check_tells_existing_names_from_missing_ones(span, ok):
    assert (check_span(span) == []) is ok, check_span(span)


def test_a_bad_reference_is_reported_at_its_line(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Page\n\nThe DAG is `plugins.training_dag.training_dag`.\n"
                    "The task was `plugins.pipeline_tasks.train`; see [the design](missing.md).\n"
                    "[Back](#no-such-heading) to [the page](#page).\n"
                    "```bash\n.venv/bin/python benchmarks/no_such_benchmark.py\n```\n")
    assert bad_references(page) == [
        "page.md:4: `plugins.pipeline_tasks.train`: plugins.pipeline_tasks defines no train",
        "page.md:4: link (missing.md): no file missing.md beside page.md",
        "page.md:5: link (#no-such-heading): page.md has no heading #no-such-heading",
        "page.md:7: `.venv/bin/python benchmarks/no_such_benchmark.py`: no file or folder "
        "benchmarks/no_such_benchmark.py",
    ]


def test_docs_name_only_what_exists():
    problems = [line for path in doc_files() for line in bad_references(path)]
    assert not problems, "the docs name what the repository does not have:\n" + "\n".join(problems)
