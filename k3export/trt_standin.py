"""Stand-ins for TensorRT's Python plugin API (TensorRT is not installable here, docs/deployment-notes): a symbolic
dimension with only what `tensorrt.plugin.ShapeExpr` supports, and `(tensorrt, tensorrt.plugin)` modules that make
the checks `tensorrt.plugin` makes when a function is registered. The CPU tests of the `plugins/<op>/trt*.py`
registrations use them (`install`), and so does `k3export build --backend tensorrt --dry-run` (`standin`), which
builds every plugin node of a rewritten graph against its registration. Not TensorRT: they cannot say whether an
engine builds."""

from __future__ import annotations

import contextlib


class Sym:
    """A symbolic dimension, `f(n)` for a value n of the free variable(s) (an int N in the tests, a dict of named
    dims in a dry run): supports `N + i`, `N - i`, `N * i`, `N // i` (as tensorrt.plugin.ShapeExpr does: no
    reflected operators) and nothing else, so `i * N`, any comparison, int() or bool(), i.e. any value-dependent
    shape, raises."""

    def __init__(self, f):
        self.f = f

    def _op(self, o, fn):
        g = o.f if isinstance(o, Sym) else (lambda n, o=o: o)
        return Sym(lambda n: fn(self.f(n), g(n)))

    def __add__(self, o): return self._op(o, lambda a, b: a + b)
    def __sub__(self, o): return self._op(o, lambda a, b: a - b)
    def __mul__(self, o): return self._op(o, lambda a, b: a * b)
    def __floordiv__(self, o): return self._op(o, lambda a, b: a // b)

    def __bool__(self):
        raise TypeError("a shape expression has no truth value")

    __int__ = __index__ = __bool__


def sym_min(a, b):
    """tensorrt.plugin.min's stand-in."""
    fa = a.f if isinstance(a, Sym) else (lambda n: a)
    fb = b.f if isinstance(b, Sym) else (lambda n: b)
    return Sym(lambda n: min(fa(n), fb(n)))


def ev(v, n):
    return v.f(n) if isinstance(v, Sym) else v



def fake_tensorrt():
    """(tensorrt, tensorrt.plugin) stand-ins with what `register_plugins` touches and the checks tensorrt.plugin
    makes when a function is registered (read from tensorrt-cu13-bindings 11.4 `plugin/_validate.py`, `_tensor.py`,
    `_top_level.py`): annotations are classes, TensorDescs first, attributes int/float/bool/str/bytes, the result a
    tuple of TensorDescs; aot_impl takes (inputs, registered attributes in order, outputs, tactic) and annotates a
    4-tuple (name, PTX, KernelLaunchParams, SymIntExprs); shape expressions have + - * // and tensorrt.plugin.min
    (which refuses two ints). Not TensorRT: it cannot say whether an engine builds."""
    import inspect
    import types
    import typing

    trt = types.ModuleType("tensorrt")
    for name in ("bfloat16", "float16", "float32", "int32", "int64"):
        setattr(trt, name, f"trt.{name}")
    trt.DataType = types.SimpleNamespace(FP8="trt.fp8")

    class TensorDesc:
        def __init__(self, shape_expr, dtype):
            self.shape_expr, self.dtype = tuple(shape_expr), dtype

        @property
        def shape(self):                # aot_impl's concrete shape: -1 where the dimension is dynamic
            return tuple(-1 if isinstance(d, Sym) else d for d in self.shape_expr)

        def like(self):
            return TensorDesc(self.shape_expr, self.dtype)

    class KernelLaunchParams:
        grid_x = grid_y = grid_z = block_x = 1
        shared_mem = 0

    class SymIntExprs(list):
        def __init__(self, n):
            super().__init__([None] * n)

    def tmin(a, b):
        if isinstance(a, int) and isinstance(b, int):
            raise ValueError("Both arguments cannot be 'int's")
        return sym_min(a, b)

    registered, aot = {}, {}

    def register(name):
        def deco(fn):
            sig = inspect.signature(fn)
            tensors, attrs = [], {}
            for p in sig.parameters.values():
                assert inspect.isclass(p.annotation), f"{name}: {p.name} annotated {p.annotation!r}"
                if issubclass(p.annotation, TensorDesc):
                    assert not attrs, f"{name}: tensor {p.name} after an attribute"
                    tensors.append(p.name)
                else:
                    assert p.annotation in (int, float, bool, str, bytes) and p.name not in ("outputs", "tactic")
                    attrs[p.name] = p.annotation
            ret = sig.return_annotation
            assert typing.get_origin(ret) is tuple and all(issubclass(a, TensorDesc) for a in typing.get_args(ret))
            registered[name] = (fn, tensors, attrs, len(typing.get_args(ret)))
            return fn
        return deco

    def aot_impl(name):
        def deco(fn):
            _, tensors, attrs, _ = registered[name]
            sig = inspect.signature(fn)
            used = [n for n in attrs if n in sig.parameters]
            assert list(sig.parameters) == tensors + used + ["outputs", "tactic"], (name, list(sig.parameters))
            for n in used:
                ann = sig.parameters[n].annotation
                assert ann is inspect.Parameter.empty or ann is attrs[n], (name, n, ann)
            args = typing.get_args(sig.return_annotation)
            assert len(args) == 4 and args[2] is KernelLaunchParams and args[3] is SymIntExprs, name
            aot[name] = fn
            return fn
        return deco

    trtp = types.ModuleType("tensorrt.plugin")
    trtp.__dict__.update(TensorDesc=TensorDesc, KernelLaunchParams=KernelLaunchParams, SymIntExprs=SymIntExprs,
                         SymInt32=lambda v: v, min=tmin, register=register, aot_impl=aot_impl,
                         ShapeExprs=types.SimpleNamespace(from_tuple=tuple), registered=registered, aot=aot)
    trt.plugin = trtp
    return trt, trtp


@contextlib.contextmanager
def standin():
    """`(tensorrt, tensorrt.plugin)` stand-ins in sys.modules for the duration (the previous entries, e.g. a real
    TensorRT's, restored after); yields them."""
    import sys
    trt, trtp = fake_tensorrt()
    saved = {n: sys.modules.get(n) for n in ("tensorrt", "tensorrt.plugin")}
    sys.modules.update({"tensorrt": trt, "tensorrt.plugin": trtp})
    try:
        yield trt, trtp
    finally:
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m


def install(monkeypatch):
    """Put the stand-ins in sys.modules as `tensorrt` / `tensorrt.plugin` for one test; returns them."""
    import sys
    trt, trtp = fake_tensorrt()
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    monkeypatch.setitem(sys.modules, "tensorrt.plugin", trtp)
    return trt, trtp
