"""scripts/gpu_check.py --jobs: sections run in processes of their own, their output printed in
section order and their results merged, and a section that crashes makes the run fail. The
sections here are stand-in processes (this machine has no GPU); the real sections' comparisons
are recorded in docs/gpu-exactness.md."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import gpu_check  # noqa: E402

# A stand-in section: prints a machine line and one PASS line per row, then writes its report;
# "slow" finishes last, "crash" raises before writing a report, "torn" leaves half a report,
# "late" crashes after writing a whole one (status 139), "fail" reports a failed row (status 1).
STAND_IN = r"""
import json, sys, time
name, report = sys.argv[1], sys.argv[2]
print('{"backend": "stand-in"}')
if name == "slow":
    time.sleep(1.0)
if name == "crash":
    raise RuntimeError("stand-in section crashed")
if name == "torn":
    open(report, "w").write('{"results": [')
    sys.exit(0)
rows = [dict(kernel=f"{name} row {i}", ok=(name != "fail"), exact=(name != "fail")) for i in range(2)]
for r in rows:
    print("PASS " if r["ok"] else "FAIL ", r["kernel"])
print(f"\n{len(rows)} comparisons")
open(report, "w").write(json.dumps(dict(info={}, results=rows)))
sys.exit(139 if name == "late" else int(name == "fail"))
"""


@pytest.fixture
def stand_in(monkeypatch):
    monkeypatch.setattr(gpu_check, "section_command",
                        lambda name, quick, report: [sys.executable, "-c", STAND_IN, name, str(report)])


def test_sections_apart_keep_their_order_and_report_crashes(stand_in, capsys):
    rows, crashed = gpu_check.run_sections_apart(["slow", "fast", "crash", "torn", "late", "last"], quick=True,
                                                 jobs=4)
    out = capsys.readouterr().out
    assert [r["kernel"] for r in rows] == ["slow row 0", "slow row 1", "fast row 0", "fast row 1",
                                           "late row 0", "late row 1", "last row 0", "last row 1"]
    assert crashed == ["crash", "torn", "late"]  # "late"'s rows are kept, but the run must fail
    # each section's output under its own heading, in the order asked, though "slow" ended last
    heads = [line.split(" (")[0] for line in out.splitlines() if line.startswith("## ")]
    assert heads == ["## slow", "## fast", "## crash", "## torn", "## late", "## last"]
    assert out.index("slow row 1") < out.index("## fast") < out.index("fast row 0")
    assert "stand-in section crashed" in out and "exit status 1" in out
    assert '"backend": "stand-in"' not in out  # each child's machine line is dropped


@pytest.mark.parametrize("sections, status", [("fast,last", 0), ("fast,fail", 1), ("fast,crash", 1),
                                              ("fast,last,fast", 0)])
def test_jobs_run_exits_by_its_sections(stand_in, monkeypatch, tmp_path, capsys, sections, status):
    monkeypatch.setattr(gpu_check, "WHICH", "cuda")  # past the no-device check; nothing runs on a GPU
    monkeypatch.setattr(gpu_check, "RESULTS", [])
    report = tmp_path / "report.json"
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--only", sections, "--jobs", "2", "--json", str(report)])
    monkeypatch.setitem(gpu_check.SECTIONS, "fast", None)  # --only accepts only known names
    for name in ("last", "fail", "crash"):
        monkeypatch.setitem(gpu_check.SECTIONS, name, None)
    assert gpu_check.main() == status
    saved = json.loads(report.read_text())
    assert len(saved["results"]) == 2 * (2 - sections.count("crash"))  # a section named twice runs once
    assert saved["crashed"] == (["crash"] if "crash" in sections else [])
    summary = capsys.readouterr().out.strip().splitlines()
    assert any(line.startswith(f"{len(saved['results'])} comparisons, ") for line in summary)
