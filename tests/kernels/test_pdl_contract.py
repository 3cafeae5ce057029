"""pdl.py's contract, read from the kernels' source: every Triton kernel taking `PDL` calls `pdl_wait(PDL)` as its
first statement, so nothing it loads or stores comes before its wait (CUDA documents the visibility of the kernels
it waits for only after the wait; a pre-wait form of "spread"'s act kernel is in docs/performance.md's tried rows)."""

from __future__ import annotations

import ast

from tests.helpers.kernel_source import jit_functions


def _pdl_kernels():
    """(file name, function) of every kernel taking the PDL constexpr (not pdl_wait itself)."""
    for f, fn in jit_functions():
        if fn.name != "pdl_wait" and "PDL" in [a.arg for a in fn.args.args + fn.args.kwonlyargs]:
            yield f, fn


def _body(fn: ast.FunctionDef) -> list[ast.stmt]:
    body = fn.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    return body


def _is_wait(stmt: ast.stmt) -> bool:
    return isinstance(stmt, ast.Expr) and ast.unparse(stmt.value) == "pdl_wait(PDL)"


def test_the_scan_finds_the_pdl_kernels():
    names = {fn.name for _, fn in _pdl_kernels()}
    assert {"gate_up_kernel", "down_kernel", "act_spread_kernel", "combine_kernel"} <= names and len(names) > 20


def test_pdl_wait_is_the_first_statement():
    late = [f"{f}:{fn.name}" for f, fn in _pdl_kernels() if not _is_wait(_body(fn)[0])]
    assert not late, f"kernels whose first statement is not pdl_wait(PDL): {late}"
