"""Counting the points where a CUDA host would wait for the device, on any machine (``HostSyncs``).

On a CUDA run the host stops at every op whose result it must read (``item``, ``nonzero``, ``unique``…:
``bench.launches.SYNC_OPS``) on a device tensor, and at every copy of a device tensor to the host
(``.cpu()``). On the CPU nothing waits, so both are counted where kvtool's code calls them:

* every ``Tensor.cpu()`` called from kvtool's code (on the CPU it may be a no-op; on CUDA a sync when the
  tensor is on the device: an upper bound);
* every sync op dispatched from kvtool's code outside the archive's host-side reads (``HOST_SIDE``: they
  work on rows read from the archive's stores, host tensors on every machine).
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bench.launches import SYNC_OPS

KVTOOL = str(Path(__file__).resolve().parents[1] / "kvtool") + "/"
#: functions of kvtool/core/archive.py whose tensors are host rows from the stores on every device
HOST_SIDE = frozenset({"read", "_rows", "_positions", "positions_of", "all_positions", "top_by_position", "touched",
                       "flush", "_decode", "_dequantize"})


def _caller(depth: int) -> tuple[str, str] | None:
    """(file, function) of the innermost frame outside torch and this module, if it is kvtool's; else None."""
    frame = sys._getframe(depth)
    while frame is not None:
        path = frame.f_code.co_filename
        if "/torch/" not in path and path != __file__:
            return (path, frame.f_code.co_name) if path.startswith(KVTOOL) else None
        frame = frame.f_back
    return None


class HostSyncs(TorchDispatchMode):
    """``with HostSyncs() as s:`` … ``s.count``: the host syncs a CUDA run would make there; ``s.where``
    counts them by kvtool source ``file:function``."""

    def __init__(self) -> None:
        super().__init__()
        self.where: collections.Counter[str] = collections.Counter()
        self._cpu = torch.Tensor.cpu

    @property
    def count(self) -> int:
        return sum(self.where.values())

    def _note(self, caller: tuple[str, str] | None, what: str) -> None:
        if caller is not None:
            self.where[f"{Path(caller[0]).name}:{caller[1]}:{what}"] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in SYNC_OPS:
            caller = _caller(2)
            if caller is not None and not (caller[0].endswith("core/archive.py") and caller[1] in HOST_SIDE):
                self._note(caller, name)
        return func(*args, **(kwargs or {}))

    def __enter__(self) -> HostSyncs:
        real, counter = self._cpu, self

        def cpu(tensor, *args, **kwargs):
            counter._note(_caller(2), "cpu")
            return real(tensor, *args, **kwargs)

        torch.Tensor.cpu = cpu  # type: ignore[method-assign]
        super().__enter__()
        return self

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        torch.Tensor.cpu = self._cpu  # type: ignore[method-assign]
