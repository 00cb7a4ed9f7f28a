"""Loading a ``.kvc``'s tensors into a fresh cache of the same engine (checked against the header first)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvtool.errors import UsageError, first_line
from kvtool.kvc.format import KvcHeader, corrupt

if TYPE_CHECKING:
    from torch import Tensor

    from kvtool.core.cache import BoundedCache


def load_tensors(header: KvcHeader, device: Any = "cpu") -> dict[str, Tensor]:
    """The file's tensors, checked against the header's checksum; positions come back as int64.

    The tensors of a cache are what its budget bounds, so they are read whole (the archive beside it,
    which grows with the document, is streamed instead: ``kvtool.kvc.archive``).
    """
    import torch
    from safetensors.torch import load_file

    from kvtool.kvc.write import tensors_digest

    try:
        tensors = load_file(header.path, device="cpu")
    except Exception as e:  # SafetensorError, OSError: the file changed or is damaged
        raise corrupt(header.path, first_line(e, 120) if str(e).strip() else "") from None
    if tensors_digest(tensors) != header.meta.get("tensors_sha256"):
        raise corrupt(header.path, "tensor data does not match its checksum")
    out = {}
    for name, t in tensors.items():
        if name.endswith((".positions", ".rotary")):
            t = t.to(torch.long)
        out[name] = t.to(device) if str(device) != "cpu" else t
    return out


def check_layout(path: str, layout: Any, cache: BoundedCache) -> None:
    """The file's head layout (groups, capacities, compensation, per-token policy state) is ``cache``'s."""
    ours = [[(list(g.heads), g.capacity, bool(g.compensation)) for g in layer.groups] for layer in cache.layers]
    try:
        theirs = [[(list(g["heads"]), g["capacity"], bool(g["compensation"])) for g in layer] for layer in layout]
    except (KeyError, TypeError):
        raise corrupt(path, "bad layout metadata") from None
    if ours != theirs:
        raise UsageError(
            f"{path} has another head layout than this run's cache (a different calibration?); prefill again"
        )
    fields = [[list(g.state_fields) for g in layer.groups] for layer in cache.layers]
    saved = [[list(g.get("state_fields", [])) if isinstance(g, dict) else [] for g in layer] for layer in layout]
    if fields != saved:  # e.g. a keydiff cache from before its per-token 1/‖k‖ (0.2)
        raise UsageError(f"{path} keeps per-token policy state {saved[0][0]}, this kvtool's policy keeps "
                         f"{fields[0][0]}; prefill it again with this kvtool")


def load_into(header: KvcHeader, cache: BoundedCache) -> None:
    """Fill the fresh ``cache`` with the file's tensors, position counter and prefill counters."""
    p, meta = header.path, header.meta
    check_layout(p, meta["layout"], cache)
    tensors = load_tensors(header)
    expected = {name for name, _ in cache.saved_views()}
    if set(tensors) != expected:
        missing = sorted(expected - set(tensors))
        raise corrupt(p, f"missing tensor {missing[0]}" if missing else "unexpected tensors")
    scalars = meta["cache"]
    seen = scalars.get("seen")
    for name, t in tensors.items():  # kept positions index per-position tables (recall): within 0..seen-1
        if name.endswith(".positions") and t.numel() and (int(t.min()) < 0 or not int(t.max()) < (seen or 0)):
            raise corrupt(p, f"tensor {name} holds positions outside the {seen} tokens read")
    try:
        cache.load(tensors, scalars)
    except (KeyError, ValueError, RuntimeError, TypeError) as e:
        raise corrupt(p, first_line(e)) from None
    for key, value in (scalars.get("counters") or {}).items():
        if hasattr(cache.counters, key) and isinstance(value, int):
            setattr(cache.counters, key, value)
