"""The tests' name for `k3export.trt_standin` (the `tensorrt.plugin` stand-in, also used by `build --dry-run`)."""

from k3export.trt_standin import Sym, ev, fake_tensorrt, install, sym_min  # noqa: F401
