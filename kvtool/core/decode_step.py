"""The fixed-shape decode step: one token through the bounded cache over static buffers, replayable on CUDA.

The cache has a fixed capacity, so a decoded token attends over the same slots at token 1 and token 10,000,
after 4K or 1M document tokens: each head group's capacity + one block. A :class:`DecodeStep` is built once
for a cache's buffers and holds, besides them, every tensor a step reads or writes at a fixed address:

    tok [1, 1]       the token fed (the chooser writes the next one over it)
    pos [1, 1]       its RoPE position (``position_ids``); ``orig`` [1] its stream position
    fills [G]        per head group, the slot the token is written to (its stored length before it)
    t [1]            the answer's index of the next token; ``ring`` [R] the answer (``Chooser.ids``)
    valid, masks     per group, which slots hold a token (unfilled slots are masked, never sliced off)

A step is then the model's forward with those tensors (``position_ids`` given, a 4-D ``attention_mask`` so
transformers builds no mask of its own, a :class:`StepCache` whose ``update`` writes K/V, positions and the
policy's new-token state with ``index_copy_`` at ``fills``), the attention over every slot with the
validity mask (``attend``, reached through the registered attention function), the policy's per-token work
on the device (H2O adds the probability row to its running sums: ``Policy.observe_fixed``), citation mass,
the chooser (greedy, guard and penalty over the whole answer buffer, masked past ``t``), and ``add_(1)`` on
the counters. No op reads a value back, none allocates cache state, no shape depends on the step. On CUDA
it is captured once as a ``torch.cuda.CUDAGraph`` and replayed; on a CPU the same code runs eagerly.

What needs the host stays outside, between steps (``Engine._decode``): the step that evicts (the spare
region full: once per block of tokens) runs through today's eager path, which also covers compact
positions' switch and renormalisation; the host's counters (``g.length``, ``cache.seen``) follow each
step (``advance``) and are written back to the device after an eager one (``sync``); the answer is read
back every few tokens. Where a configuration cannot be stepped this way (``unsupported``), decoding stays
eager and, on an accelerator, the engine says why in a note.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers.cache_utils import Cache, CacheLayerMixin

from kvtool.core.cache import BoundedCache, HeadGroup
from kvtool.core.contract import ScoreContext
from kvtool.core.positions import RotationWork, Rotator
from kvtool.core.sampling import Chooser

#: answer tokens the step's ring holds at first (it doubles, with a new capture, when an answer is longer)
FIRST_RING = 1024


def moves_positions(cache: BoundedCache, m: int = 1) -> bool:
    """Whether feeding ``m`` tokens now switches to compact positions or renormalises them (host work: the
    block path takes that step)."""
    r = cache.rope
    if r.compact:
        return r.next + m > r.limit
    return r.mode == "auto" and r.max_positions is not None and cache.seen + m > r.max_positions


def unsupported(cache: BoundedCache, choose: Chooser) -> str | None:
    """Why ``cache`` and ``choose`` cannot decode with the fixed-shape step (None: they can)."""
    if choose.reads_each_token:
        return "sampling reads each token's distribution on the host"
    if cache.codec is not None:
        return f"K/V stored as {cache.codec.name} are decoded per step"
    if cache.query_log is not None:
        return "a question's queries are being recorded"
    for layer in cache.layers:
        groups: list[HeadGroup] = layer.groups  # type: ignore[attr-defined]
        if len(groups) > 1 or groups[0].off:
            return "a per-layer head layout (RazorAttention) with a compensation slot"
        g = groups[0]
        if g.capacity is None or g.max_slots is None:
            return "an unbounded cache grows with the document"
        if g.slots < g.usable_slots:
            return "the cache's buffers are still growing toward capacity + block"
        if g.recent is not None:
            return "an int4 cache's full-precision window of recent keys"
        if "origin" in g.buffers and g.rotator is None:
            return "keys kept at their original positions without a rotator"
        if g.policy.observe_every_step and not g.policy.observe_fixed:
            return f"policy {g.policy.spec!r} observes every token with host values"
    return None


class StepLayer(CacheLayerMixin):
    """One layer of the step's cache: ``update`` writes the token into the layer's group at its fill slot."""

    is_compileable = False
    is_sliding = False

    def __init__(self, step: DecodeStep, layer_idx: int) -> None:
        super().__init__()
        self._step = weakref.ref(step)  # weak: the step holds its cache's layers, a strong one would be a cycle
        self.layer_idx = layer_idx
        self.is_initialized = True

    @property
    def step(self) -> DecodeStep:
        step = self._step()
        assert step is not None, "a decode step's cache used after the step was freed"
        return step

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        pass

    def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        self.step.write(self.layer_idx, key_states, value_states)
        return key_states, value_states  # the attention reads the group's buffers (``DecodeStep.attend``)

    def get_seq_length(self) -> int:
        return self.step.cache.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.step.slots[self.layer_idx] + query_length, 0

    def get_max_length(self) -> int:
        return self.step.slots[self.layer_idx]


class StepCache(Cache):
    """The transformers ``Cache`` the step's forward gets: one :class:`StepLayer` per model layer."""

    def __init__(self, step: DecodeStep, num_layers: int) -> None:
        super().__init__(layers=[StepLayer(step, i) for i in range(num_layers)])


class DecodeStep:
    """One decoded token over fixed buffers (module docstring); ``run`` replays it, ``eager`` takes today's path."""

    def __init__(
        self,
        model: torch.nn.Module,
        keyword: str,
        cache: BoundedCache,
        choose: Chooser,
        eos: Tensor | None,
        capture: bool,
    ) -> None:
        self.model = model
        self.keyword = keyword  # the name the model's forward takes its cache by
        # weak, like every reference kvtool keeps to a cache: the engine keeps a step per live cache only
        # (``Engine.decode_step_of``), so a document's cache, its K/V and its graph go with its last use
        self._cache = weakref.ref(cache)
        self.device = cache.device
        dev, long = cache.device, torch.long
        self.groups: list[HeadGroup] = [layer.groups[0] for layer in cache.layers]  # type: ignore[attr-defined]
        self.slots = [g.slots for g in self.groups]
        self.tok = torch.zeros(1, 1, dtype=long, device=dev)
        self.pos = torch.zeros(1, 1, dtype=long, device=dev)
        self.orig = torch.zeros(1, dtype=long, device=dev)
        # compact positions in 16 bits: the stream position minus the rotary one (constant between host steps,
        # both advance by one a token), the turn that takes a new key back to its original position
        self.delta = torch.zeros(1, 1, dtype=long, device=dev)
        # the rotators' own buffers: the cache's are shared with re-packs and recall, which may grow them between
        # replays (a captured graph would write into freed memory); made here, so no step allocates
        self.rotation_work = RotationWork()
        self.rotators: list[Rotator | None] = [None] * len(self.groups)
        for i, g in enumerate(self.groups):
            if "origin" in g.buffers and g.rotator is not None:
                rot = self.rotators[i] = Rotator(g.rotator.inv_freq, 2 * g.rotator.inv_freq.numel(), self.rotation_work)
                key = g.buffers.items["keys"].data
                rot.rotate(torch.zeros(g.num_heads, 1, key.shape[-1], dtype=key.dtype, device=dev),
                           self.delta.expand(g.num_heads, 1))
        self.t = torch.zeros(1, dtype=long, device=dev)
        self.fills = torch.zeros(len(self.groups), dtype=long, device=dev)
        self.fill = [self.fills[i : i + 1] for i in range(len(self.groups))]
        self.slot_ids = torch.arange(max(self.slots), device=dev)
        self.valid = [torch.zeros(n, dtype=torch.bool, device=dev) for n in self.slots]
        self.scratch_valid = [torch.zeros(n, dtype=torch.bool, device=dev) for n in self.slots]
        # SDPA's additive masks [1, slots], in the queries' dtype, the row 16 elements wide (then sliced): CUDA's
        # memory-efficient kernel takes them without a padded copy (as core/attention.py's folded masks)
        self.masks = [torch.zeros(1, -(-n // 16) * 16, dtype=cache.dtype, device=dev)[:, :n] for n in self.slots]
        self.new_state = [torch.zeros(len(g.state_fields), g.num_heads, 1, device=dev) for g in self.groups]
        self.mask4d = torch.zeros(1, 1, 1, 1, dtype=cache.dtype, device=dev)  # transformers builds no mask
        self.step_cache = StepCache(self, len(self.groups))
        self.eos = None if eos is None else eos.clone()
        self.choose = choose
        self.ring = torch.zeros(FIRST_RING, dtype=long, device=dev)  # the answer (``adopt``)
        self.works: dict[str, Tensor] = {}  # the chooser's work buffers, the same for every answer
        self.capture = capture and dev.type == "cuda"
        self.graph: Any = None  # torch.cuda.CUDAGraph once captured
        self.signature = self.key(cache, choose, eos)

    @property
    def cache(self) -> BoundedCache:
        cache = self._cache()
        assert cache is not None, "a decode step used after its cache was freed"
        return cache

    # -- identity: the buffers a capture holds the addresses of ------------------------------------------
    @staticmethod
    def key(cache: BoundedCache, choose: Chooser, eos: Tensor | None) -> tuple:
        """What the step's buffers and a capture depend on: the cache's buffer addresses and slot counts,
        citation on or off, the chooser's rule. Equal keys: the step (and its graph) can be replayed."""
        ptrs = tuple(
            (name, b.data.data_ptr(), b.data.shape[b.axis])
            for g in cache.groups()
            for name, b in g.buffers.items.items()
        )
        letters = None if choose.letters is None else choose.letters.data_ptr()
        gate = None if cache.mass_gate is None else cache.mass_gate.data_ptr()
        return (id(cache), ptrs, gate, choose.n, choose.penalty, letters, None if eos is None else eos.numel())

    def buffers(self) -> list[Tensor]:
        """Every tensor a step reads or writes besides the model's weights and activations (tests pin them)."""
        out = [
            self.tok,
            self.pos,
            self.orig,
            self.delta,
            *self.rotation_work.buffers.values(),
            self.t,
            self.fills,
            self.slot_ids,
            self.ring,
            self.mask4d,
            *self.valid,
            *self.scratch_valid,
            *self.masks,
            *self.new_state,
        ]
        out += [b.data for g in self.groups for b in g.buffers.items.values()] + list(self.works.values())
        return out + ([self.cache.mass_gate] if self.cache.mass_gate is not None else [])

    # -- host side, between steps ------------------------------------------------------------------------
    def adopt(self, choose: Chooser, keep: int = 0) -> None:
        """Decode the next answer with ``choose`` (its rule is in ``key``): its tokens live in the step's ring
        (stale ones past ``t`` are masked; the first ``keep`` are the ones ``choose`` already holds) and its work
        in the step's buffers, so a graph replays for it."""
        if keep:
            self.ensure_room(keep)
            self.ring[:keep].copy_(choose.ids[:keep])
        choose.ids = self.ring
        choose.works = self.works
        self.choose = choose

    def start(self, logits: Tensor, eos: Tensor | None, at: int = 0) -> None:
        """Write the host's counters into the step's tensors and choose answer token ``at`` (the first, unless
        the answer began on the block path) from ``logits``."""
        if eos is not None and self.eos is not None:
            self.eos.copy_(eos)
        self.sync()
        self.t.fill_(at)
        self.choose.choose_at(logits, self.t, self.tok)

    def sync(self) -> None:
        """The host's counters (after an eager step, or a new answer) into the device's, outside any graph."""
        cache = self.cache
        host = torch.tensor([g.length for g in self.groups], dtype=torch.long)
        self.fills.copy_(host.pin_memory() if self.device.type == "cuda" else host, non_blocking=True)
        self.orig.fill_(cache.seen)
        self.pos.fill_(cache.rope.first_rotary(cache.seen))
        self.delta.fill_(cache.seen - cache.rope.first_rotary(cache.seen))

    def ensure_room(self, t: int) -> None:
        """Room in the ring for answer token ``t``: twice the ring when it is full (a new capture follows)."""
        if t < self.ring.numel():
            return
        ring = torch.zeros(2 * self.ring.numel(), dtype=torch.long, device=self.device)
        ring[: self.ring.numel()].copy_(self.ring)
        self.ring = self.choose.ids = ring
        self.graph = None

    def run(self) -> None:
        """Feed ``tok`` and choose the next token into it: the graph's replay, or the same code eagerly."""
        timer = self.cache.timer
        t0 = timer.start()
        if self.capture and self.graph is None:
            self._capture()
        if self.graph is not None:
            self.graph.replay()
        else:
            self.body()
        self.advance()
        timer.stop("step", t0)

    def eager(self, step: Any) -> None:
        """The step that evicts (or moves compact positions): ``step`` (``Engine.step``) feeds ``tok`` the way
        a block is fed, host work included; then the chooser, and the device's counters from the host's."""
        cache = self.cache
        if cache.mass_gate is not None and self.eos is not None:
            cache.close_mass_on(self.tok.view(1), self.eos)
        logits = step(cache, self.tok.view(1), 1)
        self.t.add_(1)
        self.choose.choose_at(logits[-1], self.t, self.tok)
        self.sync()

    def advance(self) -> None:
        """The host's counters after a step: every group holds one more token, one more was seen."""
        cache = self.cache
        for g in self.groups:
            g.length += 1
        cache.step.length = 1
        cache.end_step()  # seen, the compact counter, the cache's stored-length counters (nothing deferred)

    # -- the step itself (device work only) ----------------------------------------------------------------
    def body(self) -> None:
        """One token: forward, attention over every slot, the policy's per-token work, the next token."""
        cache = self.cache
        if cache.mass_gate is not None and self.eos is not None:
            cache.close_mass_on(self.tok.view(1), self.eos)  # an end token: the steps after it add no mass
        out = self.model(
            input_ids=self.tok,
            position_ids=self.pos,
            attention_mask=self.mask4d,
            **{self.keyword: self.step_cache},
            use_cache=True,
            logits_to_keep=1,
            kvtool_step=self,
        )
        self.t.add_(1)
        self.choose.choose_at(out.logits[0, -1], self.t, self.tok)
        self.pos.add_(1)
        self.orig.add_(1)
        self.fills.add_(1)

    def write(self, layer_idx: int, key_states: Tensor, value_states: Tensor) -> None:
        """The token's K/V, positions and new-token policy state into slot ``fill`` of the layer's group;
        every other per-token buffer (citation mass) gets 0 there, as an append gives it."""
        g, fill = self.groups[layer_idx], self.fill[layer_idx]
        keys, values = key_states[0], value_states[0]
        if not g.all_heads:
            keys, values = keys.index_select(0, g.kv_index), values.index_select(0, g.kv_index)
        items = g.buffers.items
        h = g.num_heads
        src = {"keys": keys, "values": values, "positions": self.orig.expand(h, 1), "rotary": self.pos.expand(h, 1)}
        rotator = self.rotators[layer_idx]
        if rotator is not None:  # as ``HeadGroup.append``: the key turned back to its stream position
            src["origin"] = rotator.rotate(keys, self.delta.expand(h, 1))
        state = self.new_state[layer_idx]
        if state.numel():
            consts = g.policy.constants(keys, values)
            state.zero_()
            for name, value in consts.items():
                state[g.state_fields.index(name)].copy_(value)
            src["state"] = state
        for name, b in items.items():
            if name in src:
                b.data.index_copy_(b.axis, fill, src[name])
            elif b.data.numel():
                b.data.index_fill_(b.axis, fill, 0)

    def attend(self, module: torch.nn.Module, query: Tensor, scaling: float, softcap: float | None) -> Tensor:
        """The layer's attention for the step's token over every slot of its group, unfilled slots masked;
        returns ``[1, 1, heads, d]`` as the registered attention function does."""
        i = module.layer_idx  # type: ignore[attr-defined]
        g = self.groups[i]
        q = query if g.all_heads else query.index_select(1, g.q_index)
        keys, values = g.keys, g.values  # [1, h, slots, d]: every slot
        valid = torch.le(self.slot_ids[: self.slots[i]], self.fill[i], out=self.valid[i])
        if g.window is not None:  # a sliding group: also within the window of the token's stream position
            near = torch.lt(torch.sub(self.orig, g.positions[0]), g.window, out=self.scratch_valid[i])
            valid.logical_and_(near)
        observe = g.policy.observe_every_step
        h, qk, d = keys.shape[1], g.q_per_kv, q.shape[-1]
        if softcap is None and not observe and g.mass is None:
            mask = self.masks[i].zero_().masked_fill_(~valid, float("-inf"))
            out = F.scaled_dot_product_attention(q.reshape(1, h, qk, d), keys, values, attn_mask=mask, scale=scaling)
        else:
            probs = self._probs(q, keys, valid, scaling, softcap, h, qk, d)
            out = torch.bmm(probs.to(values.dtype), values[0])
            if observe:
                self._observe(i, g, probs.sum(1, keepdim=True).div_(qk))
            if g.mass is not None:
                assert self.cache.mass_gate is not None
                g.mass.addcmul_(probs.sum(1), self.cache.mass_gate)
        return out.reshape(1, h * qk, 1, values.shape[-1]).transpose(1, 2).contiguous()

    @staticmethod
    def _probs(
        q: Tensor, keys: Tensor, valid: Tensor, scaling: float, softcap: float | None, h: int, qk: int, d: int
    ) -> Tensor:
        """Softmax(cap(q kᵀ · scale)) over every slot in float32, unfilled slots at 0: [h, q_per_kv, slots]."""
        scores = torch.bmm(q[0].float().reshape(h, qk, d), keys[0].float().transpose(1, 2)).mul_(scaling)
        if softcap is not None:
            scores.div_(softcap).tanh_().mul_(softcap)
        scores.masked_fill_(~valid, float("-inf"))
        return torch.softmax(scores, dim=-1, out=scores)

    def _observe(self, i: int, g: HeadGroup, probs: Tensor) -> None:
        """The policy's per-token work over every slot (``observe_fixed``: unfilled slots add 0)."""
        cache = self.cache
        state = {name: g.state[f] for f, name in enumerate(g.state_fields)}
        g.policy.observe(
            ScoreContext(
                layer_idx=i,
                heads=g.heads,
                keys=cache._empty,
                values=cache._empty,
                positions=g.positions,
                query_positions=self.orig,
                probs=probs,
                state=state,
                protected=None,
                capacity=g.capacity or g.slots,
                block_len=1,
            )
        )

    # -- capture (CUDA) --------------------------------------------------------------------------------------
    def _mutable(self) -> list[Tensor]:
        """What a step changes besides the slot it writes: restored after the capture's warm-up step."""
        out = [self.tok, self.pos, self.orig, self.delta, self.t, self.fills, self.ring]
        for g in self.groups:
            out += [g.state] + ([g.mass] if g.mass is not None else [])
        return out + ([self.cache.mass_gate] if self.cache.mass_gate is not None else [])

    def _capture(self) -> None:
        """Record ``body`` as a CUDA graph: one warm-up step on a side stream (its effects undone), then the
        capture. Where capture fails (an op that syncs or allocates cache state in some model's code), the
        step stays eager and ``failure`` says why (the engine notes it)."""
        saved = [x.clone() for x in self._mutable()]
        try:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                self.body()
            torch.cuda.current_stream(self.device).wait_stream(side)
            for x, v in zip(self._mutable(), saved, strict=True):
                x.copy_(v)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.body()
        except RuntimeError as e:
            for x, v in zip(self._mutable(), saved, strict=True):
                x.copy_(v)
            self.capture = False
            self.failure = str(e).splitlines()[0] if str(e) else type(e).__name__
            return
        self.graph = graph

    def take_failure(self) -> str | None:
        """Why the capture failed, once (the engine notes it once; the step then stays eager)."""
        failure, self.failure = self.failure, None
        return failure

    failure: str | None = None
