"""The one benchmark report (``benchmarks/run.py``): a result file records the command that
produced it, and ``--record`` puts such a file's figure into the table with that command, while
``--merge`` keeps the other rows of the last report."""
from __future__ import annotations

import json
import sys

import pytest

from benchmarks import run  # noqa: E402
from testkit.result_file import command_line, write_json

pytestmark = pytest.mark.unit


def test_a_result_file_records_its_command_without_the_json_option(tmp_path, monkeypatch):
    out = tmp_path / "r.json"
    monkeypatch.setattr(sys, "argv", ["/x/benchmarks/goodput.py", "--period-s", "300", "--json", str(out), "--epochs", "50"])
    write_json(str(out), {"figure": 1})
    assert json.loads(out.read_text()) == {"figure": 1, "command": "benchmarks/goodput.py --period-s 300 --epochs 50"}
    assert command_line(["constrained_links.py", "--json=/tmp/x", "--quick"]) == "benchmarks/constrained_links.py --quick"


def _n1_result(command: str) -> dict:
    point = {"rate_mbit": 50.0, "step_time_s": 0.18, "measured_comm_s": 0.176, "predicted_comm_s": 0.218,
             "measured_over_predicted": 0.81}
    return {"unconstrained": {"step_time_s": 0.0047}, "sweep": [point], "command": command}


def test_record_takes_the_figure_and_command_from_the_file(tmp_path):
    bench = next(b for b in run.BENCHES if b.id == "N1")
    path = tmp_path / "n1.json"
    path.write_text(json.dumps(_n1_result("benchmarks/constrained_links.py --rates 50")))
    row = run.recorded(bench, str(path))
    assert row["command"] == "benchmarks/constrained_links.py --rates 50"
    assert row["ratio"] == pytest.approx(0.81) and "50 Mbit/s 180 ms" in row["figure"]


def test_record_refuses_another_scripts_file(tmp_path):
    bench = next(b for b in run.BENCHES if b.id == "N1")
    path = tmp_path / "g1.json"
    path.write_text(json.dumps(_n1_result("benchmarks/goodput.py --period-s 300")))
    with pytest.raises(ValueError, match="not by benchmarks/constrained_links.py"):
        run.recorded(bench, str(path))


def test_merge_keeps_the_rows_not_measured_now(tmp_path, monkeypatch):
    readme, results = tmp_path / "README.md", tmp_path / "results.json"
    readme.write_text(f"# B\n\n{run.BEGIN}\nold\n{run.END}\n\n## section\n")
    old = {"id": "P7", "measure": "parse", "goal": "g", "command": "benchmarks/parse_time.py 3", "date": "2026-01-01",
           "seconds": 1.0, "figure": "0.1 s", "ratio": None, "met": True}
    results.write_text(json.dumps({"header": "h", "rows": [old]}))
    n1 = tmp_path / "n1.json"
    n1.write_text(json.dumps(_n1_result("benchmarks/constrained_links.py --quick")))
    monkeypatch.setattr(run, "README", str(readme))
    monkeypatch.setattr(run, "RESULTS", str(results))
    monkeypatch.setattr(sys, "argv", ["run.py", "--record", f"N1={n1}", "--merge"])
    run.main()
    text = readme.read_text()
    assert "| P7 | parse | g | 0.1 s | — | yes | 2026-01-01 |" in text  # kept, with its own date
    assert "| N1 |" in text and "`benchmarks/constrained_links.py --quick`" in text
    assert text.index("| P7 |") < text.index("| N1 |")  # the report's order
    assert text.endswith("## section\n") and "old" not in text
    assert [r["id"] for r in json.loads(results.read_text())["rows"]] == ["P7", "N1"]


def test_every_benchmark_script_imports():
    """A script the report runs must at least import: a helper renamed elsewhere once broke one
    unnoticed until the report ran it."""
    import importlib
    import pathlib

    folder = pathlib.Path(run.REPO) / "benchmarks"
    broken = {}
    for path in sorted(folder.glob("*.py")):
        try:
            importlib.import_module(f"benchmarks.{path.stem}")
        except Exception as exc:  # noqa: BLE001 - every failure is reported at once
            broken[path.name] = f"{type(exc).__name__}: {exc}"
    assert not broken, broken


def test_the_report_renders_the_planners_predictions_beside_the_measurements():
    # An N1 point at 50 Mbit/s measured at exactly the model's figure (worked out by hand in
    # tests/unit/test_perf_model.py: 0.1935 s), one at 200 Mbit/s at twice it.
    raw = {"workers": 2, "servers": 1, "hidden": [256, 256],
           "sweep": [{"rate_mbit": 50.0, "measured_comm_s": 0.19347}, {"rate_mbit": 200.0, "measured_comm_s": 0.0847}]}
    row = {"id": "N1", "measure": "m", "goal": "g", "figure": "f", "ratio": None, "met": None, "date": "d",
           "command": "benchmarks/constrained_links.py --quick", "raw": raw}
    block = run.table([row], "header")
    assert "### Predicted vs measured" in block and block.index("Predicted") < block.index(run.END)
    [line] = [ln for ln in block.splitlines() if "tbf at 50, 200 Mbit/s" in ln]
    assert "| 1.00 / 2.00 |" in line and "**no**" in line


def test_the_run_queue_mean_is_over_the_window_or_the_nearest_sample():
    from testkit.run_queue import RunQueueSampler, procs_running

    rq = RunQueueSampler()
    rq.samples = [(10.0, 2), (10.5, 4), (11.0, 9), (20.0, 3)]
    assert rq.mean(10.0, 11.0) == pytest.approx(5.0)  # (2 + 4 + 9) / 3
    assert rq.mean(19.0, 19.2) == 3.0  # no sample inside: the nearest
    assert (procs_running() or 1) >= 1  # this test's own thread is running
