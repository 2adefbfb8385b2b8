"""The agent supports Python 3.10 (Ubuntu 22.04's), not only the 3.11 it is developed on: the unit suite runs on
a 3.10 interpreter too (the venv scripts/setup.sh makes for it)."""

from __future__ import annotations

import os
import subprocess

from tests.conftest import REPO, require

PY310 = REPO / ".venv-py310" / "bin" / "python"


def test_unit_suite_passes_on_python_3_10() -> None:
    require(PY310.exists(), "no Python 3.10 venv (.venv-py310; make setup-test makes it where a 3.10 exists)")
    version = subprocess.run([str(PY310), "-c", "import sys; print(sys.version_info[:2])"], capture_output=True,
                             text=True, check=True).stdout.strip()
    assert version == "(3, 10)", version
    r = subprocess.run([str(PY310), "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/unit"], cwd=REPO,
                       capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONDONTWRITEBYTECODE="1"))
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert " passed" in r.stdout.splitlines()[-1], r.stdout[-500:]
