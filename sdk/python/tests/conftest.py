"""Fixtures of the Python SDK's tests: the sidecar's own test fixtures (the real
`tapline-sidecar` binary, `$TAPLINE_SIDECAR_BIN` or `target/debug/tapline-sidecar`, and
the fake OpenAI/Anthropic upstream), loaded from `sidecar/tests/python/conftest.py` under
another module name so that both suites can run in one pytest session.

The SDK under test is the installed `tapline` package (`pip install ./sdk/python`); when
it is not installed, `sdk/python/src` is used instead.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]
SIDECAR_TESTS = REPO_ROOT / "sidecar" / "tests" / "python"


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


sidecar_fixtures = _load("tapline_sidecar_conftest", SIDECAR_TESTS / "conftest.py")

# Everything public of it, fixtures included, is also this module's. The sidecar's tests
# do `from conftest import payloads, ...`, which finds whichever conftest pytest loaded
# last: when that is this one, they find the same names here.
for _name in dir(sidecar_fixtures):
    if not _name.startswith("__"):
        globals().setdefault(_name, getattr(sidecar_fixtures, _name))

try:
    import tapline  # noqa: F401
except ImportError:  # not installed: test the source tree
    sys.path.insert(0, str(REPO_ROOT / "sdk" / "python" / "src"))
