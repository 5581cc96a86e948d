"""The model card's rendering (``training.tracking.model_card``): every section, from a real shard
manifest (``data_checks.shard.shard_dataset`` on local files) and a real ``TrainConfig``; hostile
text from the data and the user stays text in the Markdown and the HTML; the review's update."""
from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from common.config import TrainConfig, recipe
from common.manifest import manifest_digest, manifest_uri
from data_checks.shard import shard_dataset
from training.tracking import model_card as mc
from training.tracking.gate import DEFAULT_GATE, evaluate_gate

pytestmark = pytest.mark.unit

HOSTILE = "<script>alert(1)</script>|**x**"
SECTIONS = ("## Data", "### Rows per split", "### Labels per split", "## Preprocessing", "## Config and code",
            "## Test metrics", "## Gate", "## Training, cost and hardware", "## Lineage")


def _frame(n: int = 240, seed: int = 3) -> pd.DataFrame:
    rng = np.random.RandomState(seed)
    frame = pd.DataFrame(rng.randn(n, 3), columns=["f0", "f1", "f2"])
    # A class whose name is markup: it reaches the card through the manifest's classes.
    frame["label"] = np.where(rng.rand(n) > 0.5, "cat", HOSTILE)
    return frame


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> tuple[TrainConfig, dict, str]:
    base = tmp_path_factory.mktemp("card")
    source = str(base / "pets.csv")
    _frame().to_csv(source, index=False)
    cfg = recipe("debug", source)
    prefix = str(base / "shards")
    return cfg, shard_dataset(cfg, prefix), prefix


def _card(cfg: TrainConfig, manifest: dict, prefix: str, **changes: object) -> mc.ModelCard:
    fields = dict(
        name="pets", version="3", created_at="2026-12-06T23:00:00Z",
        data=mc.data_facts(manifest, manifest_uri=manifest_uri(prefix), digest=manifest_digest(manifest)),
        config=json.loads(cfg.to_json()), config_digest=cfg.digest(), git_commit="c0ffee1234567890", model_code_sha256="",
        model_sha256="ab" * 32, test_metrics={"accuracy_score": 0.91, "f1_score": 0.9, "test_accuracy": 0.91},
        champion=mc.Champion(None), gate=mc.Gate(mc.GATE_PENDING),
        training=mc.Training(global_step=120, epochs=3, loop_seconds=mc.loop_seconds(
            [{"global_step": 40, "step_time_s": 0.01}, {"global_step": 80, "step_time_s": 0.02},
             {"global_step": 120, "step_time_s": 0.01}]), wall_seconds=42.0, attempts=2, restarts=1,
            resumed_from_step=40, backend="local", num_workers=2, num_servers=1, device="cpu",
            devices_per_worker=1, instance_type="", cost={"cost.core_seconds": 81.5, "cost.usd": 0.02}),
        lineage=mc.Lineage(dag_id="mxnet_training", run_id="manual__2026-12-06T23:00:00+00:00",
                           airflow_run_url="http://airflow:8080/dags/mxnet_training/runs/manual__2026-12-06T23:00:00+00:00",
                           mlflow_run_id="r123", mlflow_run_url="http://mlflow:5000/#/experiments/1/runs/r123",
                           checkpoints_prefix="s3://b/mxnet_training/run/checkpoints",
                           model_prefix="s3://b/mxnet_training/run/model", shards_prefix=prefix,
                           logged_model_id="m-1"))
    return mc.ModelCard(**{**fields, **changes})


def test_every_section_holds_the_values_of_the_manifest_and_config(sharded):
    cfg, manifest, prefix = sharded
    card = _card(cfg, manifest, prefix)
    text = mc.markdown(card)
    for section in SECTIONS:
        assert f"\n{section}\n" in text, section
    splits = manifest["splits"]
    rows = f"| {splits['train']['count']} | {splits['val']['count']} | {splits['test']['count']} |"
    assert "| train | val | test |" in text and rows in text
    # Labels per split by class name (the manifest keys them by class index).
    cat = manifest["classes"].index("cat")
    assert f"| cat | {splits['train']['label_histogram'][str(cat)]} |" in text
    assert manifest_digest(manifest) in text and manifest["source_sha256"] in text
    assert manifest["source_fingerprint"] in text
    assert cfg.digest() in text and "c0ffee1234567890" in text and "ab" * 32 in text
    assert json.dumps(json.loads(cfg.to_json()), indent=2, sort_keys=True) in text  # the resolved config, whole
    # The debug recipe standardises: the fitted mean of a column is in the preprocessing table.
    f0 = next(c for c in manifest["preprocessing"]["inputs"] if c["name"] == "f0")
    assert f"| f0 | numeric | mean {f0['mean']:.4f}" in text
    assert "There is no champion yet" in text and "Pending: the review" in text
    assert "training loop 1.6 s" in text and "| cost.core\\_seconds | 81.500 |" in text
    assert "2 worker(s) × 1 cpu context(s), 1 server(s), backend local" in text
    assert "[mxnet\\_training / manual\\_\\_2026-12-06T23:00:00\\+00:00](http://airflow:8080/dags/" in text
    assert "s3://b/mxnet\\_training/run/checkpoints" in text
    page = mc.html(text, "card")
    assert '<a href="http://mlflow:5000/#/experiments/1/runs/r123">r123</a>' in page
    assert page.count("<table>") == 5  # rows, labels, preprocessing, metrics, cost: rendered as tables


def test_champion_figures_and_the_reviews_gate(sharded):
    cfg, manifest, prefix = sharded
    card = _card(cfg, manifest, prefix, champion=mc.Champion("2", {"accuracy_score": 0.95}, "as registered"))
    text = mc.markdown(card)
    assert "Beside champion version 2" in text and "| accuracy\\_score | 0.9100 | 0.9500 | -0.0400 |" in text

    from mlflow.models import EvaluationResult

    mine, theirs = {"accuracy_score": 0.91}, {"accuracy_score": 0.95}
    outcome = evaluate_gate(DEFAULT_GATE, EvaluationResult(mine, {}), EvaluationResult(theirs, {}))
    after = mc.reviewed(card, outcome, mine, "2", theirs, "rev-1")
    assert after.gate.status == "failed" and card.gate.status == mc.GATE_PENDING  # the original is kept
    text = mc.markdown(after)
    assert "**Failed**: accuracy\\_score 0.9100 is not" in text and "Review run rev-1" in text
    assert "| accuracy_score | 0.9100 | 0.9500 | >= champion - 0.01 (0.9400) | fail |" in text
    summary = mc.summary(after, "runs:/r123/model_card/reviewed.html")
    assert "gate: failed" in summary and "accuracy_score 0.9100 (champion 0.9500, Δ -0.0400)" in summary
    assert mc.ModelCard.from_dict(json.loads(json.dumps(after.to_dict()))) == after  # the JSON artifact


def test_hostile_text_stays_text(sharded):
    cfg, manifest, prefix = sharded
    assert HOSTILE in manifest["classes"]
    card = _card(cfg, manifest, prefix, name="m|<img src=x onerror=alert(1)>",
                 gate=mc.Gate("failed", reason=f"{HOSTILE}\n# heading", review_run_id="r"),
                 lineage=dataclass_replace(_card(cfg, manifest, prefix).lineage,
                                           airflow_run_url="javascript:alert(1)", dag_id="d`|`"),
                 config={**json.loads(cfg.to_json()), "note": "```\n<b>bold</b>"})
    text = mc.markdown(card)
    summary = mc.summary(card)
    for md in (text, summary):
        # No raw HTML, and a URL that is not http(s) is shown as text, never a link.
        assert "<script>" not in md and "<img" not in md and "](javascript" not in md
        assert "javascript:alert\\(1\\)" in md
    # Each table row is still one row with its columns: the class name's pipe is escaped.
    assert "| &lt;script&gt;alert\\(1\\)&lt;/script&gt;\\|\\*\\*x\\*\\* |" in text
    assert "\n# heading" not in text  # the reason's line break is flattened
    page = mc.html(text, card.name)
    assert "<script>" not in page and "<img" not in page and "<b>bold</b>" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;|**x**" in page  # shown, as text
    assert 'href="javascript' not in page
    # The HTML itself takes no raw HTML from the Markdown (a second line of defence).
    assert "<script>" not in mc.html("<script>alert(1)</script>\n\n<b>x</b>", "t")
    assert "<title>Model card? m|&lt;img" not in page and "<title>m|&lt;img src=x onerror=alert(1)&gt;</title>" in page


def dataclass_replace(obj, **changes):
    import dataclasses

    return dataclasses.replace(obj, **changes)


def test_a_regression_card_has_its_target_statistics(tmp_path):
    rng = np.random.RandomState(0)
    frame = pd.DataFrame(rng.randn(200, 3), columns=["a", "b", "c"])
    frame["target"] = 3 * frame["a"] + rng.randn(200) + 10
    source = str(tmp_path / "reg.csv")
    frame.to_csv(source, index=False)
    cfg = TrainConfig.from_dict({"data": {"source_uri": source, "label_column": "target"},
                                 "model": {"task": "regression"}})
    manifest = shard_dataset(cfg, str(tmp_path / "shards"))
    card = _card(cfg, manifest, str(tmp_path / "shards"), test_metrics={"test_rmse": 1.1, "test_r2": 0.8})
    text = mc.markdown(card)
    target = manifest["preprocessing"]["targets"][0]
    assert "### Targets" in text and f"| target | {target['mean']:.4f} | {target['std']:.4f} |" in text
    assert "### Labels per split" not in text
    assert "- test (no champion yet): test_rmse 1.1000; test_r2 0.8000" in mc.summary(card)
