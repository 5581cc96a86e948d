"""Where a backend's machines are: the deployment's settings, given as JSON text (an Airflow
Variable, which ``plugins.connections`` fetches) or read from the settings files of the Airflow
workers.

The config says which backend a run uses (``cluster.backend``) and how big its job is; the
machines themselves are the deployment's, not the run's: a JSON list of hosts
(``infra.transport.HostSpec`` fields) for ``hosts``, a JSON object of
``infra.ec2_cluster.Ec2Options`` fields (region, launch template, subnet, spot, ...) for ``ec2``.
Given text (a ``SettingsSource`` whose text is set) wins; otherwise ``MXPIPE_HOSTS_FILE`` /
``MXPIPE_EC2_FILE`` name the file. The settings are checked as strictly as the config
(``infra.strict_settings``): an unknown key is refused with the nearest known one, a value of
the wrong type is refused. Missing or malformed settings are a ``ClusterSettingsError`` (the
same settings fail the same way, so the task fails without a retry), each line naming where
they came from (``Airflow Variable mxpipe_ec2: unknown config key 'spto' (did you mean 'spot'?)``).
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from common.config import ClusterConfig
from common.settings import settings
from infra.cluster import ClusterSpec
from infra.cluster import reap as reap_records
from infra.strict_settings import ClusterSettingsError, StrictSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SettingsSource:
    """A backend's settings as JSON text from outside the settings file: ``where`` names it in
    errors (``Airflow Variable mxpipe_hosts``); ``text`` None means it is not set there."""

    where: str
    text: str | None


def _settings_file(backend: str) -> tuple[str, str | None]:
    """The variable naming ``backend``'s settings file, and its value now."""
    current = settings()
    return {"hosts": ("MXPIPE_HOSTS_FILE", current.hosts_file), "ec2": ("MXPIPE_EC2_FILE", current.ec2_file)}[backend]


def _document(backend: str, source: SettingsSource | None) -> tuple[str, Any]:
    """``(where, parsed JSON)`` of the backend's settings: the given text, else the file."""
    if source is not None and source.text is not None:
        try:
            return source.where, json.loads(source.text)
        except ValueError as exc:
            raise ClusterSettingsError(f"{source.where}: not a JSON document: {exc}") from exc
    var, path = _settings_file(backend)
    if not path:
        also = f" or the {source.where}" if source is not None else ""
        raise ClusterSettingsError(f"backend {backend!r} needs {var} (a JSON file describing its machines){also}")
    try:
        with open(path) as fh:
            return f"{var}={path}", json.load(fh)
    except (OSError, ValueError) as exc:
        raise ClusterSettingsError(f"{var}={path}: cannot read a JSON document from it: {exc}") from exc


def cluster_options(backend: str, source: SettingsSource | None = None) -> dict[str, Any]:
    """``ClusterSpec.options`` of ``backend``: ``{}`` for local, ``{"hosts": [...]}`` for hosts,
    the EC2 options object for ec2; from ``source`` where it holds text, else the file."""
    if backend == "local":
        return {}
    where, raw = _document(backend, source)
    wanted = list if backend == "hosts" else dict
    if not isinstance(raw, wanted):
        raise ClusterSettingsError(f"{where}: expected a JSON {'list of hosts' if wanted is list else 'object'}, "
                                   f"got {type(raw).__name__}")
    # Checked here, where the settings' origin is known, so a typo fails the provision task (or
    # the reaper) naming it; the options keep the document as written (the cluster's record).
    if backend == "hosts":
        from infra.transport import HostSpec

        _check([line for i, host in enumerate(raw) for line in _problems(HostSpec, host, f"{where}: hosts[{i}]")])
        return {"hosts": raw}
    from infra.ec2_cluster import Ec2Options

    _check(_problems(Ec2Options, raw, where))
    return raw


def _problems(model: type[StrictSettings], raw: Any, where: str) -> list[str]:
    """What is wrong with ``raw`` as a ``model``, one line per problem starting with ``where``."""
    try:
        model.from_dict(raw)
    except ClusterSettingsError as exc:
        return [f"{where}: {line}" for line in str(exc).splitlines()]
    return []


def _check(problems: list[str]) -> None:
    if problems:
        raise ClusterSettingsError("\n".join(problems))


def cluster_spec(run_tag: str, cluster: ClusterConfig, instance_type: str = "",
                 source: SettingsSource | None = None) -> ClusterSpec:
    """A run's ``ClusterSpec``: its shape and backend from the config, its machines from the
    backend's settings (``cluster_options``), its TTL from ``MXPIPE_CLUSTER_TTL_S``.
    ``instance_type`` (a run's choice) wins over the settings'."""
    options = cluster_options(cluster.backend, source)
    return ClusterSpec(run_tag=run_tag, workers=cluster.num_workers, servers=cluster.num_servers,
                       backend=cluster.backend, devices_per_worker=int(options.get("devices_per_worker", 0)),
                       instance_type=str(instance_type or options.get("instance_type", "")),
                       image=str(options.get("image", "")), ttl_s=settings().cluster_ttl_s, options=options)


def reap(older_than_s: float = 0.0, ec2: SettingsSource | None = None) -> dict[str, Any]:
    """Tear down every cluster past its TTL: the shared records (``infra.cluster.records_root``:
    S3, so any Airflow worker's reaper sees every worker's clusters), and (where EC2 settings exist:
    ``ec2`` holds text, or ``MXPIPE_EC2_FILE`` is set) EC2 instances by their tags, which the
    reaper finds even if a record was lost."""
    reaped: dict[str, Any] = {"clusters": reap_records(older_than_s)}
    if (ec2 is not None and ec2.text is not None) or settings().ec2_file:
        from infra.ec2_cluster import Ec2Options, reap_expired

        reaped["ec2_instances"] = reap_expired(Ec2Options.from_dict(cluster_options("ec2", ec2)),
                                               older_than_s=older_than_s)
    log.info("reaper: %s", reaped)
    return reaped
