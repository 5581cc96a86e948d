"""The deployment's settings as models as strict as the config (``common.config``): the hosts of
the ``hosts`` backend (``infra.transport.HostSpec``) and the options of the ``ec2`` backend
(``infra.ec2_cluster.Ec2Options``), whether they come from an Airflow Variable, a settings file
or a cluster's record.

A value of the wrong type is refused, never converted (``"spot": "true"``, ``"ssh_port": "22"``),
and an unknown key is refused by name with the nearest known one (``unknown config key 'spto'
(did you mean 'spot'?)``): a typo would otherwise be dropped in silence and the default used.
The base and the messages are the config's own (``common.config.StrictModel``), one line per
problem; every problem is a ``ClusterSettingsError``, and ``infra.cluster_settings`` puts where
the settings came from in front of each line.
"""
from __future__ import annotations

from typing import Any, Self

# The config's strict, closed, frozen base and its one-line messages (field path, what it must be,
# the did-you-mean hint): reused, so the settings read exactly like the config.
from common.config import ConfigError, StrictModel
from common.errors import DeterministicError


class ClusterSettingsError(DeterministicError, ValueError):
    """A backend's settings are missing or malformed: deterministic, not worth a retry."""


class StrictSettings(StrictModel):
    """The config's base (``common.config.StrictModel``) with the settings' own error."""

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ConfigError as exc:
            raise ClusterSettingsError(str(exc)) from None

    @classmethod
    def from_dict(cls, raw: Any) -> Self:
        """Build from a JSON object (a sequence value may be a list)."""
        if not isinstance(raw, dict):
            raise ClusterSettingsError(f"expected a JSON object of {cls.__name__} fields, got {type(raw).__name__}")
        bad = [key for key in raw if not isinstance(key, str)]
        if bad:
            raise ClusterSettingsError(f"keys must be strings, got {bad[0]!r}")
        return cls(**raw)
