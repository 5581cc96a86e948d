"""Infrastructure: the local service stack, cluster backends and hardware planning.

- ``services``: the local service stack (SeaweedFS S3, MLflow, Airflow 3): up, down, status, env.
- ``stack_config``: where one local stack lives: home, ports, credentials, the environments built from them.
- ``processes``: service processes launched in sessions of their own, pid files, bounded waits.
- ``s3_service``: SeaweedFS as the stack's S3, credentials enforced, one bucket.
- ``airflow_service``: Airflow 3 for the local stack: its configuration, DB migration, components.
- ``airflow_client``: a small client for the Airflow 3 REST API v2, every call bounded.
- ``cluster``: the one interface over every place a job's roles can run, and the leak reaper.
- ``local_cluster``: the default backend: every role a process on this machine.
- ``hosts_cluster``: the ``hosts`` backend: a static list of machines reached through a transport.
- ``ec2_cluster``: the ``ec2`` backend: instances launched through boto3, roles through SSM.
- ``cluster_settings``: where a backend's machines are: the deployment's settings.
- ``strict_settings``: the deployment settings' strict base and their error (``ClusterSettingsError``).
- ``topology``: the scaled-out deployment on network-namespace hosts of this machine: up, down, status.
- ``netns``: hosts made of network namespaces: the bridge, veth links, an uplink, sshd's configuration.
- ``transport``: how a command reaches a host of the ``hosts`` backend (SSH, ``ip netns exec``).
- ``planning``: hardware planning: memory per device for a model, and which cluster to ask for.
- ``perf_model``: the planner's time model: communication, start, supervisor, checkpoints, sharding, fitted on measurements.
- ``catalogue``: the GPU instance types the planner chooses from, as data.
- ``billing``: what a cluster's machines have cost so far: instance-hours and their price.
- ``__main__``: ``python -m infra`` is ``python -m infra.services``.

Never imports Airflow. Keep this file free of heavy imports: ``python -m infra.services`` and the
test fixtures import submodules directly.
"""
