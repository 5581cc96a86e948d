"""Where a backend's machines come from: the settings files of the hosts and EC2 backends, and
the run's ``ClusterSpec`` built from the config plus those files."""
import json

import pytest

from common.config import recipe
from infra.cluster_settings import ClusterSettingsError, cluster_options, cluster_spec

pytestmark = pytest.mark.unit

HOSTS = [{"name": "h0", "address": "10.0.0.1"}, {"name": "h1", "address": "10.0.0.2"}]


def _write(tmp_path, name, value):
    path = tmp_path / name
    path.write_text(value if isinstance(value, str) else json.dumps(value))
    return str(path)


def test_local_needs_no_settings(monkeypatch):
    monkeypatch.delenv("MXPIPE_HOSTS_FILE", raising=False)
    monkeypatch.delenv("MXPIPE_EC2_FILE", raising=False)
    assert cluster_options("local") == {}


@pytest.mark.parametrize("backend,var", [("hosts", "MXPIPE_HOSTS_FILE"), ("ec2", "MXPIPE_EC2_FILE")])
def test_a_missing_variable_names_it(monkeypatch, backend, var):
    monkeypatch.delenv(var, raising=False)
    with pytest.raises(ClusterSettingsError, match=f"backend '{backend}' needs {var}"):
        cluster_options(backend)


@pytest.mark.parametrize("backend,var,content,needle", [
    ("hosts", "MXPIPE_HOSTS_FILE", "[{not json", "cannot read a JSON document"),
    ("hosts", "MXPIPE_HOSTS_FILE", {"hosts": HOSTS}, "expected a JSON list of hosts, got dict"),
    ("ec2", "MXPIPE_EC2_FILE", ["lt-1"], "expected a JSON object, got list"),
])
def test_a_malformed_file_is_refused_readably(monkeypatch, tmp_path, backend, var, content, needle):
    monkeypatch.setenv(var, _write(tmp_path, "settings.json", content))
    with pytest.raises(ClusterSettingsError, match=needle):
        cluster_options(backend)


def test_an_unreadable_file_is_refused_readably(monkeypatch, tmp_path):
    monkeypatch.setenv("MXPIPE_HOSTS_FILE", str(tmp_path / "nope.json"))
    with pytest.raises(ClusterSettingsError, match=r"MXPIPE_HOSTS_FILE=.*nope\.json: cannot read"):
        cluster_options("hosts")


def test_the_spec_takes_shape_and_backend_from_the_config(monkeypatch, tmp_path):
    monkeypatch.setenv("MXPIPE_HOSTS_FILE", _write(tmp_path, "hosts.json", HOSTS))
    monkeypatch.setenv("MXPIPE_CLUSTER_TTL_S", "600")
    cfg = recipe("debug").replace(cluster={"backend": "hosts", "num_workers": 3, "num_servers": 2})
    spec = cluster_spec("dag--run", cfg.cluster)
    assert (spec.backend, spec.workers, spec.servers, spec.ttl_s) == ("hosts", 3, 2, 600.0)
    assert spec.options == {"hosts": HOSTS} and spec.run_tag == "dag--run"


def test_a_runs_instance_type_wins_over_the_ec2_file(monkeypatch, tmp_path):
    ec2 = {"launch_template": "lt-1", "instance_type": "c5.large", "devices_per_worker": 2, "image": "img:1"}
    monkeypatch.setenv("MXPIPE_EC2_FILE", _write(tmp_path, "ec2.json", ec2))
    cluster = recipe("debug").replace(cluster={"backend": "ec2"}).cluster
    assert cluster_spec("t", cluster).instance_type == "c5.large"
    spec = cluster_spec("t", cluster, "g5.xlarge")
    assert (spec.instance_type, spec.devices_per_worker, spec.image) == ("g5.xlarge", 2, "img:1")


# -- as strict as the config ----------------------------------------------------------------------

@pytest.mark.parametrize("backend,var,content,lines", [
    ("ec2", "MXPIPE_EC2_FILE", {"launch_template": "lt-1", "spto": True, "poll_s": "5"},
     ["poll_s must be a number, got '5' (a string)", "unknown config key 'spto' (did you mean 'spot'?)"]),
    ("ec2", "MXPIPE_EC2_FILE", {"subnet_id": "subnet-1"},
     ["the ec2 backend needs launch_template (see infra/cloudformation)"]),
    ("hosts", "MXPIPE_HOSTS_FILE", [HOSTS[0], {"name": "h1", "address": "10.0.0.2", "transport": "sssh"}, "10.0.0.3"],
     ["hosts[1]: transport must be one of ('ssh', 'netns', 'local'), got 'sssh'",
      "hosts[2]: expected a JSON object of HostSpec fields, got str"]),
    ("hosts", "MXPIPE_HOSTS_FILE", [{"name": "h0", "address": "10.0.0.1", "ssh_options": "BatchMode=no"}],
     ["hosts[0]: ssh_options must be a list, got 'BatchMode=no' (a string)"]),
])
def test_every_problem_of_a_settings_file_is_refused_naming_the_file(monkeypatch, tmp_path, backend, var, content,
                                                                      lines):
    path = _write(tmp_path, "settings.json", content)
    monkeypatch.setenv(var, path)
    with pytest.raises(ClusterSettingsError) as refused:
        cluster_options(backend)
    assert str(refused.value).splitlines() == [f"{var}={path}: {line}" for line in lines]


def test_the_settings_models_refuse_unknown_keys_and_wrong_types_themselves():
    """What a cluster's record or a caller hands them directly (no file, no Variable to name)."""
    from infra.ec2_cluster import Ec2Options
    from infra.transport import HostSpec

    with pytest.raises(ClusterSettingsError, match=r"^unknown config key 'spto' \(did you mean 'spot'\?\)$"):
        Ec2Options.from_dict({"launch_template": "lt-1", "spto": True})
    with pytest.raises(ClusterSettingsError, match=r"^scheduler_port must be an integer, got 9091\.0 \(a number\)$"):
        Ec2Options.from_dict({"launch_template": "lt-1", "scheduler_port": 9091.0})
    with pytest.raises(ClusterSettingsError, match=r"^unknown config key 'port' \(did you mean 'ssh_port'\?\)$"):
        HostSpec.from_dict({"name": "h0", "address": "10.0.0.1", "port": 22})
    with pytest.raises(ClusterSettingsError, match=r"^host h0: the netns transport needs a namespace name$"):
        HostSpec(name="h0", address="10.0.0.1", transport="netns")
    good = Ec2Options.from_dict({"launch_template": "lt-1", "spot": True, "poll_s": 1, "devices_per_worker": 1})
    assert (good.spot, good.poll_s, good.devices_per_worker, good.region) == (True, 1, 1, "us-east-1")
    host = HostSpec.from_dict({"name": "h0", "address": "10.0.0.1", "ssh_options": ["BatchMode=yes"]})
    assert host.ssh_options == ("BatchMode=yes",) and host.ssh_port == 22
