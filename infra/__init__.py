"""Infrastructure: the local service stack, cluster backends and hardware planning.

Never imports Airflow. Keep this file free of heavy imports: ``python -m infra.services`` and the
test fixtures import submodules directly.
"""
