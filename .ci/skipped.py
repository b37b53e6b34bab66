"""Print every test the CI run skipped (or expected to fail), with its reason, from pytest's junit
report: ``python3 .ci/skipped.py REPORT.xml``. Standard library only (it runs after the tests,
whatever state the virtualenv is in)."""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def skipped(report: Path) -> list[tuple[str, str, str]]:
    """(test id, kind, reason) of each skipped test in the report, in its order."""
    out = []
    for case in ET.parse(report).getroot().iter("testcase"):
        for s in case.findall("skipped"):
            kind = "xfail" if s.get("type") == "pytest.xfail" else "skip"
            cls = case.get("classname", "")
            test_id = f"{cls}::{case.get('name', '')}" if cls else case.get("name", "")
            out.append((test_id, kind, (s.get("message") or s.text or "").strip()))
    return out


def main(argv: list[str]) -> int:
    report = Path(argv[1]) if len(argv) > 1 else Path(".venv/ci-junit.xml")
    if not report.exists():
        print(f"SKIPPED IN CI: no report at {report} (the tests did not run to the end)")
        return 1
    rows = skipped(report)
    print()
    print(f"==== SKIPPED IN CI: {len(rows)} ====")
    for test_id, kind, reason in rows:
        print(f"  {test_id}  [{kind}]  {reason}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
