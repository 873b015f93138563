"""What a CUDA graph's capture refuses, caught on a CPU: while a stream is captured, nothing may wait for the GPU
(a value read back: `.item()`, `int(t)`, `bool(t)`, `.tolist()`; an output whose shape depends on values: `nonzero`, a
boolean mask's index) and nothing may copy from pageable host memory (a tensor made from Python data on the device).
On a GPU either one fails the capture, and that decode step size then runs eagerly. On a CPU nothing fails, so
`HostReads` records them: a TorchDispatchMode sees every aten op the code under it dispatches, and the Python methods
that read a tensor's data without one (`tolist`, `numpy`) are wrapped while it is on.

A zero-dim tensor from a Python number (`t[i:] = 1`) is not counted: torch fills from the number on the host, without a
copy. Inside a compiled call (`unobserved`) inductor's own kernels run; they are not looked into.
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

import servelab

aten = torch.ops.aten
PACKAGE = str(Path(servelab.__file__).parent.parent)

_READS = {
    aten._local_scalar_dense.default: "reads a value back to the host (.item(), int(), float())",
    aten.item.default: "reads a value back to the host (.item(), int(), float())",
    aten.is_nonzero.default: "reads a value back to the host (bool() of a tensor, an `if` on one)",
    aten.equal.default: "reads a value back to the host (torch.equal)",
    aten.nonzero.default: "shapes its output by values (nonzero)",
    aten.masked_select.default: "shapes its output by values (masked_select)",
    aten._unique2.default: "shapes its output by values (unique)",
    aten.repeat_interleave.Tensor: "shapes its output by values (repeat_interleave by a tensor of counts)",
}
_INDEXING = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}


class HostReads(TorchDispatchMode):
    """Records each op that a CUDA graph capture refuses, with the project's own line that ran it."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        why = _READS.get(func)
        if func in _INDEXING and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] or ()):
            why = "indexes by a boolean mask (a nonzero: shapes its output by values)"
        if func is aten.lift_fresh.default and args[0].dim() > 0:
            why = "makes a tensor from host data (torch.tensor of a list: a copy from pageable memory)"
        if why is not None:
            self._record(str(func), why)
        return func(*args, **(kwargs or {}))

    def _record(self, name: str, why: str) -> None:
        here = [f for f in traceback.extract_stack() if f.filename.startswith(f"{PACKAGE}/servelab/")]
        where = f"{Path(here[-1].filename).relative_to(PACKAGE)}:{here[-1].lineno}" if here else "outside servelab"
        self.found.append(f"{name} at {where}: {why}")

    @contextlib.contextmanager
    def observing(self) -> Iterator[HostReads]:
        """This mode on, with torch.Tensor's data readers that dispatch no op (tolist, numpy) wrapped to be counted."""
        originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy")}

        def counted(name: str, original: Callable) -> Callable:
            def read(tensor, *args, **kwargs):
                self._record(f"Tensor.{name}", "reads values back to the host")
                return original(tensor, *args, **kwargs)
            return read

        try:
            for name, original in originals.items():
                setattr(torch.Tensor, name, counted(name, original))
            with self:
                yield self
        finally:
            for name, original in originals.items():
                setattr(torch.Tensor, name, original)


def unobserved(fn: Callable) -> Callable:
    """fn run with no dispatch mode on: a compiled call (dynamo compiles nothing under a TorchDispatchMode)."""
    def call(*args, **kwargs):
        with _disable_current_modes():
            return fn(*args, **kwargs)
    return call
