"""The repository's benchmarks/ and scripts/ as modules, for the tests of their pure parts. They are not a
package: each is imported under its file's stem (the name its siblings import it by: each puts its own folder
on sys.path), once."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def load_script(relpath: str, skip_missing: bool = False) -> ModuleType:
    """`relpath` (from the repository root, e.g. "benchmarks/decode.py") imported as the module of its stem
    (the one already imported from that file, if any). `skip_missing`: skip the calling test module when an
    import inside it fails (a benchmark that needs triton, on a machine without it)."""
    path = (ROOT / relpath).resolve()
    name = path.stem
    loaded = sys.modules.get(name)
    if loaded is not None:
        if getattr(loaded, "__file__", None) and Path(loaded.__file__).resolve() == path:
            return loaded
        raise RuntimeError(f"module {name!r} is already imported from {loaded.__file__}, not {path}")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except ImportError as e:
        del sys.modules[name]
        if skip_missing:
            pytest.skip(f"{relpath}: {e}", allow_module_level=True)
        raise
    return module
