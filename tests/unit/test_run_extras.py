"""training.tracking.run_extras: the PNGs and the mlflow.data input a training run carries (no server)."""
import pytest

from training.tracking.run_extras import manifest_dataset, plot_artifacts

pytestmark = pytest.mark.unit

PNG = b"\x89PNG\r\n\x1a\n"


def test_plots_are_pngs(tmp_path):
    history = [{"epoch": e, "train_loss": 1 / (e + 1), "val_accuracy": 0.5 + e / 10} for e in range(4)]
    evaluation = {"confusion_matrix": [[3, 1], [0, 4]], "classes": ["a", "b"]}
    made = plot_artifacts(history, evaluation, str(tmp_path / "plots"))
    assert set(made) == {"plots/curves.png", "plots/confusion_matrix.png"}
    for path in made.values():
        with open(path, "rb") as f:
            assert f.read(8) == PNG


def test_no_history_no_curve(tmp_path):
    made = plot_artifacts([], {"confusion_matrix": [[1]], "classes": [0]}, str(tmp_path))
    assert set(made) == {"plots/confusion_matrix.png"}


def test_manifest_dataset_names_source_and_digest():
    ds = manifest_dataset({"source_uri": "s3://b/data/digits.csv"}, "s3://b/runs/shards/abc/manifest.json",
                          "f" * 64)
    assert ds.name == "digits.csv" and ds.digest == "f" * 36
    assert ds.source.uri == "s3://b/runs/shards/abc/manifest.json"
