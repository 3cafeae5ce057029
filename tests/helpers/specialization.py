"""Which compiled variant a Triton launch needs, computed on the host: Triton compiles a kernel once per
signature, so a launch whose signature no earlier launch had compiles (on a GPU, 0.1-1.5 s each).

The signature, as Triton specializes it: each constexpr's value; each int's type (i32 / i64) and, unless the kernel
lists it in `do_not_specialize`, whether it equals 1 and whether it is a multiple of 16; each tensor's dtype and
whether its address is 16-byte aligned; bools, floats and None by kind; the launch options (num_warps, ...)."""

from __future__ import annotations

import contextlib
import inspect

import torch
import triton.language as tl


def launch_key(kernel, args: tuple, kwargs: dict) -> tuple:
    """(kernel name, the specialization of its arguments, its launch options) of one launch of `kernel`
    (a `triton.jit` function, compiled or interpreted)."""
    fn = kernel.fn
    sig = inspect.signature(fn)
    bound = sig.bind_partial(*args, **{k: v for k, v in kwargs.items() if k in sig.parameters})
    listed = getattr(kernel, "do_not_specialize", None) or getattr(kernel, "kwargs", {}).get("do_not_specialize")
    plain = {name for i, name in enumerate(sig.parameters) if name in (listed or ()) or i in (listed or ())}
    parts = []
    for name, param in sig.parameters.items():
        if name not in bound.arguments:
            continue
        v = bound.arguments[name]
        if param.annotation is tl.constexpr or str(param.annotation).endswith("constexpr"):
            parts.append((name, repr(v)))
        elif isinstance(v, bool) or v is None or isinstance(v, float):
            parts.append((name, type(v).__name__))
        elif isinstance(v, int):
            parts.append((name, v >= 2**31, None if name in plain else (v == 1, v % 16 == 0)))
        elif isinstance(v, torch.Tensor):
            parts.append((name, str(v.dtype), v.data_ptr() % 16 == 0))
        else:
            parts.append((name, type(v).__name__))
    options = tuple(sorted((k, repr(v)) for k, v in kwargs.items() if k not in sig.parameters
                           and k not in ("grid", "warmup")))
    return fn.__name__, tuple(parts), options


@contextlib.contextmanager
def recording_launches(record):
    """While open, every Triton launch calls `record(key)` (`launch_key`'s) and is skipped: the host's path alone
    runs (it branches on no tensor value), so a step of any size costs only its Python."""
    import triton.runtime.interpreter as interp
    import triton.runtime.jit as jit

    patched = []
    for cls in (jit.JITFunction, getattr(interp, "InterpretedFunction", None)):
        if cls is None or "run" not in vars(cls):
            continue

        def run(self, *a, **kw):
            record(launch_key(self, a, kw))

        patched.append((cls, cls.run))
        cls.run = run
    try:
        yield
    finally:
        for cls, real in patched:
            cls.run = real
