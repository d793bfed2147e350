"""tests/vectors/lax_int.json is what pydantic answers today: the table the
filter's and the simulator's Rust tests read was computed with pydantic v2
(tests/vectors/lax_int.py), and this recomputes it. It runs wherever a
Python with pydantic 2 is found: this interpreter, else the system
`python3`; without one it is skipped (the committed table still drives the
Rust tests)."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvasir_harness import REPO

SCRIPT = REPO / "tests" / "vectors" / "lax_int.py"
TABLE = REPO / "tests" / "vectors" / "lax_int.json"


def _python_with_pydantic() -> str | None:
    if importlib.util.find_spec("pydantic") is not None:
        return sys.executable
    for candidate in ("python3", "/usr/bin/python3"):
        path = shutil.which(candidate)
        if path and subprocess.run([path, "-c", "import pydantic; assert pydantic.VERSION >= '2'"],
                                   capture_output=True, timeout=60).returncode == 0:
            return path
    return None


def test_the_table_is_what_pydantic_answers():
    py = _python_with_pydantic()
    if py is None:
        pytest.skip("no Python with pydantic 2 here")
    r = subprocess.run([py, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    now, committed = json.loads(r.stdout), json.loads(TABLE.read_text())
    # Another pydantic version may be installed: the answers must agree,
    # whichever version gave them.
    now.pop("pydantic"), committed.pop("pydantic")
    assert now == committed, "tests/vectors/lax_int.json is stale: run `python3 tests/vectors/lax_int.py --write`"


def test_the_table_covers_what_it_claims():
    t = json.loads(TABLE.read_text())
    errors = {v["error"] for v in t["ints"] if "error" in v}
    assert errors == {"int_parsing", "int_parsing_size", "int_from_float", "int_type"}, errors
    assert any(v["json"].startswith('"') and "value" in v for v in t["ints"]), "no accepted string"
    assert {b["api"] for b in t["bodies"]} == {"chat", "completions"}
    assert any("accepted" in b for b in t["bodies"]) and any("message" in b for b in t["bodies"])
