"""Record the kernel variants a launcher would compile on a GPU, on a machine without one.

    launcher(cpu tensors)  ──kernel[grid](...)──>  Triton binder (specialises the arguments
                                                   exactly as on a GPU: dtypes, int == 1,
                                                   16-divisibility of pointers and strides)
                           ──jit_cache_hook──────> KernelVariant recorded; compile and launch
                                                   are skipped (the hook answers "handled")

So the variant list comes from the launchers' own code (tile rules, constexprs, num_warps), never
from a copy of it. A stand-in driver names the CUDA target the binder specialises for; Triton's
specialisation is the same on every NVIDIA capability, the target only matters at compile time.
Needs compiled Triton (not TRITON_INTERPRET), and must not share a process with kernels that
are meant to run: it replaces the active driver while it records.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator

from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver


@dataclass(frozen=True)
class KernelVariant:
    """One compiled kernel: what `triton.compile(ASTSource(...))` needs, in hashable form."""

    kernel: str                  # the @triton.jit function's name
    module: str                  # its module (to find the function again in a worker process)
    signature: tuple             # ((arg name, type such as "*bf16", "i32", "constexpr"), ...)
    constants: tuple             # ((arg index path, value), ...)
    attrs: tuple                 # ((arg index path, ((attr, value), ...)), ...) e.g. divisibility
    num_warps: int
    num_stages: int
    label: str                   # the launch that produced it, e.g. "decode bf16/fp8 bs16 d128"

    def key(self) -> tuple:
        """Identity for de-duplication: everything except the label."""
        return (self.module, self.kernel, self.signature, self.constants, self.attrs,
                self.num_warps, self.num_stages)


class _RecordingDriver:
    """Just enough of a Triton driver for the binder: a device, a stream and a CUDA target."""

    def __init__(self, capability: int) -> None:
        self.capability = capability

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", self.capability, 32)


def _freeze(value):
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    return value


@contextlib.contextmanager
def recording(capability: int = 90) -> Iterator[Callable[[str], list[KernelVariant]]]:
    """Inside the block, kernel launches are recorded instead of compiled and run.

    Yields `take(label)`: the variants recorded since the last call, labelled. The JIT functions'
    per-device binder caches are cleared on the way out, so a later real launch re-binds.
    """
    recorded: list[tuple[object, dict]] = []
    seen_fns = []

    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
        recorded.append((fn.jit_function, compile))
        seen_fns.append(fn.jit_function)
        return True  # handled: Triton neither compiles nor launches

    def take(label: str) -> list[KernelVariant]:
        out = []
        for jit_fn, c in recorded:
            (attrs,) = c["configs"]
            out.append(KernelVariant(
                kernel=jit_fn.__name__, module=jit_fn.fn.__module__,
                signature=tuple(c["signature"].items()),
                constants=tuple(sorted((_freeze(k), v) for k, v in c["constants"].items())),
                attrs=tuple(sorted((_freeze(k), _freeze(v)) for k, v in attrs.items())),
                num_warps=c["num_warps"], num_stages=c["num_stages"], label=label))
        recorded.clear()
        return out

    old_hook, old_driver = knobs.runtime.jit_cache_hook, driver._active  # None: not chosen yet
    knobs.runtime.jit_cache_hook = hook
    driver.set_active(_RecordingDriver(capability))
    try:
        yield take
    finally:
        knobs.runtime.jit_cache_hook = old_hook
        driver._active = old_driver  # reset_active() would look for a real GPU driver
        for jit_fn in {id(f): f for f in seen_fns}.values():
            jit_fn.device_caches.clear()
