"""No Triton helper returns a value from inside an `if` with code after it.

Triton's compiler does not stop at a `return` inside a constexpr `if` of a called `@triton.jit` function: it
goes on to the statements after the `if`, so the helper's last `return` wins (or fails to compile), while
Triton's interpreter, which the CPU tests run, follows Python. The fp8 weight-only GEMM's tile loader had
this shape and compiled on no GPU. A kernel's bare `return` (an early exit on a runtime condition) is
fine; a helper gives its result once, at its end.
"""

from __future__ import annotations

import ast
from pathlib import Path

KERNELS = Path(__file__).resolve().parents[2] / "kernels"

_FALLS_THROUGH = '''
import triton
import triton.language as tl

@triton.jit
def load(ptrs, EVEN: tl.constexpr):
    if EVEN:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=ptrs is not None)
'''

_ONE_RETURN = '''
import triton
import triton.language as tl

@triton.jit
def load(ptrs, EVEN: tl.constexpr):
    if EVEN:
        tile = tl.load(ptrs)
    else:
        tile = tl.load(ptrs, mask=ptrs is not None)
    return tile

@triton.jit
def kernel(x_ptr, n):
    if tl.program_id(0) >= n:
        return
    tl.store(x_ptr, 1)
'''


def _is_jit(fn: ast.FunctionDef) -> bool:
    for decorator in fn.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        if isinstance(target, ast.Attribute) and target.attr == "jit":
            return True
    return False


def _value_returns_before_more_code(body: list[ast.stmt]) -> list[int]:
    """Line numbers of `if` statements holding a `return <value>` with statements after them."""
    found = []
    for i, statement in enumerate(body):
        if isinstance(statement, ast.If):
            returns = [n for n in ast.walk(statement) if isinstance(n, ast.Return) and n.value is not None]
            if returns and i < len(body) - 1:
                found.append(statement.lineno)
            found += _value_returns_before_more_code(statement.body) + _value_returns_before_more_code(statement.orelse)
        elif isinstance(statement, (ast.For, ast.While, ast.With)):
            found += _value_returns_before_more_code(statement.body)
    return found


def offending_jit_functions(source: str) -> list[str]:
    """`name:line` of each @triton.jit function in `source` that returns a value early."""
    return [f"{fn.name}:{line}" for fn in ast.walk(ast.parse(source))
            if isinstance(fn, ast.FunctionDef) and _is_jit(fn) for line in _value_returns_before_more_code(fn.body)]


def test_the_check_finds_the_pattern_and_passes_the_fix():
    assert offending_jit_functions(_FALLS_THROUGH) == ["load:7"]
    assert offending_jit_functions(_ONE_RETURN) == []


def test_no_kernel_helper_returns_early():
    sources = sorted(KERNELS.rglob("*.py"))
    assert len(sources) > 10
    offending = {path.name: found for path in sources if (found := offending_jit_functions(path.read_text()))}
    assert offending == {}
