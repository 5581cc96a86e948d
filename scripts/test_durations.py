"""Write ``tests/durations.json`` (seconds per test file) from a pytest JUnit XML report.

``make test`` writes ``.local/test-report.xml``; the suite's conftest hands files to the
pytest-xdist workers longest first by these figures (longest-processing-time first keeps the
workers' ends close). A run with a hung test records its timeout: refresh from a clean run. The figures only order the files: a stale or missing entry changes
the suite's wall time, never its result.

    .venv/bin/python scripts/test_durations.py [.local/test-report.xml]
"""
from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "durations.json"


def file_seconds(report: Path) -> dict[str, float]:
    """Each test file's summed test time (setup, call and teardown, as JUnit records them)."""
    seconds: dict[str, float] = defaultdict(float)
    for case in ET.parse(report).getroot().iter("testcase"):
        # classname is the dotted module path plus any class: tests.unit.test_x[.TestY]
        parts = case.get("classname", "").split(".")
        module = next((i for i, p in enumerate(parts) if p.startswith("test_")), None)
        if module is None:
            continue
        seconds["/".join(parts[:module + 1]) + ".py"] += float(case.get("time", 0))
    return {name: round(s, 1) for name, s in sorted(seconds.items())}


def main(argv: list[str]) -> None:
    report = Path(argv[0]) if argv else ROOT / ".local" / "test-report.xml"
    if not report.is_file():
        raise SystemExit(f"no JUnit report at {report}: run `make test` first")
    OUT.write_text(json.dumps(file_seconds(report), indent=1) + "\n")
    print(f"wrote {OUT.relative_to(ROOT)} from {report}")


if __name__ == "__main__":
    main(sys.argv[1:])
