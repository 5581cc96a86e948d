"""The reference pages generated from the code (scripts/gen_docs.py) are the committed ones, and
every config field carries the description they show."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from common.config import TrainConfig
from scripts import gen_docs

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


def test_the_committed_pages_are_what_the_script_writes():
    stale = gen_docs.stale()
    assert not stale, f"stale generated docs {stale}: run {gen_docs.COMMAND} and commit the result"


def test_every_config_field_has_a_description():
    schema = TrainConfig.model_json_schema()
    sections = [schema, *(d for name, d in schema["$defs"].items() if name.endswith("Config"))]
    missing = [f"{s.get('title', 'TrainConfig')}.{name}" for s in sections
               for name, prop in s["properties"].items() if not prop.get("description")]
    assert not missing, f"give these fields a Field(description=...) in common/config.py: {missing}"


def test_a_changed_page_is_named_as_stale(tmp_path):
    for rel, text in gen_docs.pages().items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert gen_docs.stale(tmp_path) == []
    (tmp_path / "docs/environment.md").write_text(gen_docs.pages()["docs/environment.md"] + "edited by hand\n")
    (tmp_path / "docs/configuration.md").unlink()
    assert gen_docs.stale(tmp_path) == ["docs/configuration.md", "docs/environment.md"]


def test_the_script_runs_on_its_own_and_checks():
    done = subprocess.run([sys.executable, "scripts/gen_docs.py", "--check"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
