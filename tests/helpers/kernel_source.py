"""The Triton kernels under moelora/kernels as their source's syntax trees, for tests of what every kernel must do
(the PDL wait first, a profiler category each)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

KERNELS = Path(__file__).resolve().parents[2] / "moelora" / "kernels"


def jit_functions() -> Iterator[tuple[str, ast.FunctionDef]]:
    """(file name, function) of every `@triton.jit` function under moelora/kernels."""
    for path in sorted(KERNELS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in node.decorator_list):
                yield path.name, node
