"""Every Python file of the project compiles (tools like chaos.soak and bench/ are not
imported by the other tests)."""

import py_compile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted(p for folder in ("config", "executor", "supervisor", "health", "chaos", "bench", "tests")
                 for p in (ROOT / folder).rglob("*.py"))


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_compiles(path):
    py_compile.compile(str(path), doraise=True)
