"""A training run's config from the DAG's Params, in layers, each over the ones before:

1. the recipe (the ``recipe`` Param), with the configured dataset (``plugins.params.form_base``);
2. ``config_uri``: a JSON or YAML file of config sections on S3 or a local path, read here;
3. ``config``: a JSON object of config sections (checked against the config's JSON schema when
   the run was triggered);
4. the form's shortcut fields (``plugins.params.SHORTCUTS``) changed from their default, then
   ``data_options``, then (the sweep DAG) the ``sweep`` Param over the sweep section. The form sends every field and shows the ``digits`` recipe's values as the
   defaults, so a shortcut left at its default sets nothing (whichever recipe was chosen, its
   value stands unless config_uri or config sets the field); changed, it wins over all three.

The layers are merged field by field and the result is validated once, strictly
(``TrainConfig.from_dict``), so a combination of fields from different layers is judged as a
whole. Every problem is a ``ConfigError``: the same input fails the same way, not worth a retry.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from common.config import ConfigError, TrainConfig, overlay
from plugins.params import SHORTCUTS, form_base, form_defaults


def read_config_uri(uri: str) -> dict[str, Any]:
    """The config sections in the file ``uri``: JSON (``.json``) or YAML (PyYAML's safe loader).
    A missing file or a malformed one is a ``ConfigError``; a storage outage is not."""
    from common import storage

    try:
        text = storage.get_bytes(uri).decode()
    except FileNotFoundError:
        raise ConfigError(f"config_uri {uri}: no such file") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config_uri {uri}: not a UTF-8 text file") from None
    if uri.endswith(".json"):
        try:
            document = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"config_uri {uri} is not valid JSON: {exc.msg} at line {exc.lineno} "
                              f"column {exc.colno}") from None
    else:
        import yaml

        try:
            document = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"config_uri {uri} is not valid YAML: {' '.join(str(exc).split())}") from None
    if not isinstance(document, dict):
        raise ConfigError(f"config_uri {uri} must hold an object of config sections, got "
                          f"{type(document).__name__}")
    return document


def form_layer(params: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The shortcut fields changed from their default, as a layer. A field at its default sets
    nothing: the default is the ``digits`` recipe's value, which is not what the user chose when
    the recipe is another one (the form cannot tell "left alone" from "set to this value"). A
    missing or empty value sets nothing either."""
    defaults = form_defaults()
    layer: dict[str, dict[str, Any]] = {}
    for name, (section, field) in SHORTCUTS.items():
        value = params.get(name)
        if value is None or value == "" or value == defaults[name]:
            continue
        layer.setdefault(section, {})[field] = value
    return layer


def _overlay(raw: dict[str, Any], layer: Mapping[str, Any], source: str) -> dict[str, Any]:
    try:
        return overlay(raw, layer)
    except ConfigError as exc:  # a layer or section that is no object: say which layer
        raise ConfigError(f"{source}: {exc}") from None


def resolve(params: Mapping[str, Any]) -> TrainConfig:
    """The run's config: recipe < config_uri < config < shortcut fields changed from their default
    < data_options."""
    documents: list[tuple[str, Mapping[str, Any]]] = []
    if uri := params.get("config_uri"):
        documents.append((f"config_uri {uri}", read_config_uri(uri)))
    if params.get("config"):
        documents.append(("config", params["config"]))
    raw = form_base(params.get("recipe", "digits")).to_dict()
    for source, document in documents:
        raw = _overlay(raw, document, source)
    raw = _overlay(raw, form_layer(params), "the form fields")
    raw = _overlay(raw, {"data": params.get("data_options") or {}}, "data_options")
    if params.get("sweep"):
        raw = _overlay(raw, {"sweep": params["sweep"]}, "the sweep Param")
    return TrainConfig.from_dict(raw)
