"""training.tracking.run_extras: the PNGs and the mlflow.data input a training run carries (no server)."""
import pytest

from training.tracking.run_extras import manifest_dataset, plot_artifacts

pytestmark = pytest.mark.unit

PNG = b"\x89PNG\r\n\x1a\n"


def test_plots_are_pngs(tmp_path):
    history = [{"epoch": e, "train_loss": 1 / (e + 1), "val_accuracy": 0.5 + e / 10} for e in range(4)]
    made = plot_artifacts(history, str(tmp_path / "plots"))
    # The confusion matrix is MLflow's evaluator's (training.tracking.evaluation), not a plot of ours.
    assert set(made) == {"plots/curves.png"}
    for path in made.values():
        with open(path, "rb") as f:
            assert f.read(8) == PNG


def test_no_history_no_curve(tmp_path):
    assert plot_artifacts([], str(tmp_path)) == {}


def test_manifest_dataset_names_source_and_digest():
    ds = manifest_dataset({"source_uri": "s3://b/data/digits.csv"}, "s3://b/runs/shards/abc/manifest.json",
                          "f" * 64)
    assert ds.name == "digits.csv" and ds.digest == "f" * 36
    assert ds.source.uri == "s3://b/runs/shards/abc/manifest.json"
