"""The forms a ``warm_start`` value may take: the trigger form's pattern and the resolver's parse
agree (one pattern text, ``training.tracking.warm_start.MODEL_URI_PATTERN``); resolving a registry
reference against a real server is tests/integration/test_warm_start_model.py."""
import re

import pytest

from training.tracking.warm_start import MODEL_URI_PATTERN, WarmStartError, is_model_uri, resolve_model

pytestmark = pytest.mark.unit

ACCEPTED = ["", "manual__2026-12-03T10:00:00+00:00", "scheduled__2026-12-03T03:00:00+00:00",
            "models:/digits-classifier/3", "models:/digits-classifier@champion", "models:/a.b_c-d@latest"]
REFUSED = ["no such run!", "models:/digits-classifier", "models:/x/", "models:/x@", "models:/x/1/2",
           "models:/x/one", "models:/x@a b", "models:/bad name/1", "runs:/abc/model"]


def _form_pattern() -> str:
    pytest.importorskip("airflow.sdk")
    from plugins.params import WARM_START_PATTERN

    return WARM_START_PATTERN


@pytest.mark.parametrize("value", ACCEPTED)
def test_the_form_accepts(value):
    assert re.search(_form_pattern(), value)


@pytest.mark.parametrize("value", REFUSED)
def test_the_form_refuses(value):
    assert not re.search(_form_pattern(), value)


def test_the_resolver_parses_what_the_form_lets_through():
    for value in ACCEPTED:
        assert bool(re.match(MODEL_URI_PATTERN, value)) == is_model_uri(value), value


def test_a_malformed_registry_reference_is_refused_before_any_call():
    # No server at this address: the refusal must come from the parse, not from a connection.
    with pytest.raises(WarmStartError, match="expected models:/<name>/<version>"):
        resolve_model("models:/x/1/2", "http://127.0.0.1:9")
