"""Real-model compatibility suite: each test is one model x preset cell, written to $OBS_DIR/models/.

``tools/compat_doc.py`` turns the cells into ``docs/compatibility.md``. A cell records what was
checked (loss curve vs the framework's own AMP with its tolerance, report vs observed dtypes,
save/load, remove) and its outcome; a cell that cannot apply records why (n/a).
"""

import json
import os
from pathlib import Path

import pytest

OBS = Path(os.environ.get("OBS_DIR", ".obs")) / "models"


class Cell:
    """One model x preset result."""

    def __init__(self, framework: str, model: str, preset: str) -> None:
        self.data = {"framework": framework, "model": model, "preset": preset, "status": "fail", "checks": {}}

    def check(self, name: str, detail: str) -> None:
        self.data["checks"][name] = detail

    def na(self, why: str) -> None:
        self.data["status"] = "n/a"
        self.data["why"] = why
        self._write()
        pytest.skip(why)

    def _write(self) -> None:
        OBS.mkdir(parents=True, exist_ok=True)
        d = self.data
        (OBS / f"{d['framework']}-{d['model']}-{d['preset']}.json").write_text(json.dumps(d, indent=1))


@pytest.fixture
def cell(request):
    made = []

    def make(framework: str, model: str, preset: str) -> Cell:
        c = Cell(framework, model, preset)
        made.append(c)
        return c

    yield make
    failed = getattr(request.node, "_failed", False)
    for c in made:
        if c.data["status"] != "n/a":
            c.data["status"] = "fail" if failed else "pass"
        c._write()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.when == "call" and report.failed:
        item._failed = True
    return report
