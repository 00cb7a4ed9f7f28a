"""What a document leaves behind, measured and provoked: the bytes kvtool's objects hold, a failure injected in a
decoder layer in the middle of a block, answers that run to their cap (tests/test_many_state.py)."""

from __future__ import annotations

import torch

#: what a cache keeps across documents that holds no state: work buffers sized by the largest need so far (one
#: layer's probabilities, the archive's append buffers, the stacks' score rows and gather index) and the
#: engine's rotator (shared by its caches)
WORKSPACE = frozenset({"_scratch", "archive_work", "work", "probs", "_rows", "rotator"})


def held_bytes(root, skip: frozenset[str] = WORKSPACE) -> int:
    """Bytes of every distinct tensor storage ``root`` holds through kvtool's own objects (a cache, a session),
    but for their attributes named in ``skip``: the walk follows kvtool objects and plain containers only,
    never a model, a tokenizer or a function, so it counts what kvtool keeps (K/V, per-token buffers,
    snapshots, archives), not the weights."""
    seen: set[int] = set()
    storages: dict[int, int] = {}
    todo = [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            s = obj.untyped_storage()
            storages[s.data_ptr()] = max(storages.get(s.data_ptr(), 0), s.nbytes())
        elif isinstance(obj, dict):
            todo.extend(obj.values())
            todo.extend(k for k in obj if isinstance(k, torch.Tensor))
        elif isinstance(obj, (list, tuple, set, frozenset)):
            todo.extend(obj)
        elif type(obj).__module__.startswith("kvtool.") and hasattr(obj, "__dict__") and not isinstance(obj, type):
            todo.extend(v for k, v in vars(obj).items() if k not in skip)
    return sum(storages.values())


def decoder_layers(model) -> list[torch.nn.Module]:
    """The model's decoder layers, in order (every family names its layer class ``...DecoderLayer``)."""
    return [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]


class Fault:
    """Raise ``error`` in decoder layer ``layer``'s forward on the ``nth`` model forward (1-based) of a ``phase``
    — ``read`` (the document), ``question`` (the pinned question, fed twice with recall) or ``decode`` — told
    apart by the cache the engine hands the model: a failure in the middle of a block, after the layers
    before ``layer`` appended (and maybe deferred their eviction). Also records every cache the model was fed
    with (``caches``) and whether the fault fired. Use as a context manager; ``arm()`` for each document."""

    def __init__(self, model, phase: str = "read", nth: int = 3, layer: int = 1,
                 error: type[BaseException] = torch.OutOfMemoryError) -> None:
        self.model, self.phase, self.nth, self.layer, self.error = model, phase, nth, layer, error
        self.armed = False
        self.fire = False
        self.fired = 0
        self.count = 0
        self.caches: list = []  # every distinct cache fed to the model
        self._handles: list = []

    def arm(self, phase: str | None = None, nth: int | None = None) -> Fault:
        self.phase, self.nth = phase or self.phase, nth or self.nth
        self.armed, self.count = True, 0
        return self

    def _model_forward(self, module, args, kwargs) -> None:
        step = kwargs.get("kvtool_step")  # the fixed-shape decode step hands its cache through itself
        cache = kwargs.get("kvtool_cache") if step is None else step.cache
        if cache is None:
            return
        if not any(c is cache for c in self.caches):
            self.caches.append(cache)
        phase = "decode" if cache.lazy else "read" if cache.pin_start is None else "question"
        if self.armed and phase == self.phase:
            self.count += 1
            self.fire = self.count == self.nth

    def _layer_forward(self, module, args) -> None:
        if self.fire:
            self.fire = self.armed = False
            self.fired += 1
            raise self.error(f"injected in layer {self.layer}")

    def __enter__(self) -> Fault:
        self._handles = [self.model.register_forward_pre_hook(self._model_forward, with_kwargs=True),
                         decoder_layers(self.model)[self.layer].register_forward_pre_hook(self._layer_forward)]
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()


def endless_answers(model, end_ids) -> torch.utils.hooks.RemovableHandle:
    """Make every answer run to ``max_new_tokens``: the end tokens' logits are -inf (a random model would
    otherwise end its answers after a token or two, before any lazy eviction). Returns the hook's handle."""
    ids = sorted(end_ids)

    def hook(module, args, out) -> None:
        out.logits[..., ids] = float("-inf")

    return model.register_forward_hook(hook)
