"""The "MLflow run" extra link: registered globally by an AirflowPlugin, resolves to the run URL
of the register task's XCom on train and register, and is empty on every other task.

The XCom read (``register_xcom``) is replaced here by a function returning what register
returns; the query itself runs only against a real metadata DB (not exercised in this test)."""
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.dag

URL = "http://127.0.0.1:5000/#/experiments/1/runs/abc"


def test_plugin_registers_the_link_globally():
    from plugins.links import MlflowRunLink, MxpipeLinksPlugin

    assert any(isinstance(link, MlflowRunLink) for link in MxpipeLinksPlugin.global_operator_extra_links)
    assert MlflowRunLink().name == "MLflow run"


def test_link_resolves_to_the_run_url_on_train_and_register(dag, monkeypatch):
    from plugins import links

    seen = []

    def fake_xcom(dag_id, run_id):
        seen.append((dag_id, run_id))
        return {"run_url": URL, "version": "3"} if run_id == "manual__done" else None

    monkeypatch.setattr(links, "register_xcom", fake_xcom)
    monkeypatch.setattr(links, "live_run_url", lambda dag_id, run_id: "")  # no live run either
    link = links.MlflowRunLink()
    key = SimpleNamespace(dag_id="mxnet_training", run_id="manual__done", task_id="train", map_index=-1)
    for task_id in ("train", "register"):
        assert link.get_link(dag.get_task(task_id), ti_key=key) == URL
    assert link.get_link(dag.get_task("shard"), ti_key=key) == ""
    # Before register has succeeded there is no URL yet.
    assert link.get_link(dag.get_task("train"), ti_key=SimpleNamespace(**{**key.__dict__, "run_id": "r2"})) == ""
    assert seen == [("mxnet_training", "manual__done")] * 2 + [("mxnet_training", "r2")]


def test_link_resolves_to_the_live_run_while_the_job_trains(dag, monkeypatch):
    from plugins import links

    monkeypatch.setattr(links, "register_xcom", lambda dag_id, run_id: None)
    monkeypatch.setattr(links, "live_run_url", lambda dag_id, run_id: URL if run_id == "manual__training" else "")
    key = SimpleNamespace(dag_id="mxnet_training", run_id="manual__training", task_id="train", map_index=-1)
    assert links.MlflowRunLink().get_link(dag.get_task("train"), ti_key=key) == URL
