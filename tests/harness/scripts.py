"""Loading a benchmark script (benchmarks/<name>.py) as a module in a unit test."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def load_benchmark(name: str):
    """benchmarks/<name>.py as a module, with benchmarks/ on sys.path while it loads (the
    scripts import each other); skips the test where benchmarks/ is not part of the checkout."""
    path = BENCH / f"{name}.py"
    if not path.exists():
        pytest.skip("benchmarks/ is not part of this checkout")
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(BENCH))
    return mod
