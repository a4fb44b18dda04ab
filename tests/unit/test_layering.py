"""The layering rules hold: flows -> tasks -> dapo_core, dapo_core free of Prefect, algo free of the rest, no
cycles.

The static contracts live in pyproject.toml ([tool.importlinter]); `make lint` runs them too. The dynamic
check below also catches imports that static analysis cannot see (importlib with a string, imports inside
functions that run at import time).
"""

from __future__ import annotations

import pkgutil
import subprocess
import sys
from pathlib import Path

import dapo_core

ROOT = Path(__file__).resolve().parents[2]


def test_import_linter_contracts_are_kept():
    exe = Path(sys.executable).with_name("lint-imports")
    proc = subprocess.run([str(exe)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 broken" in proc.stdout


def test_importing_all_of_dapo_core_loads_no_prefect_tasks_or_flows():
    modules = sorted(m.name for m in pkgutil.walk_packages(dapo_core.__path__, "dapo_core."))
    # vllm_rollout needs the vllm package (GPU env / .venv-vllm); import everything else.
    modules = [m for m in modules if not m.endswith("vllm_rollout")]
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('prefect', 'tasks', 'flows'))\n"
        "print(len(sys.modules)); assert not bad, bad\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(modules) > 40
