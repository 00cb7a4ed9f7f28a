"""The bounded KV cache: per layer, per group of KV heads, fixed capacity, preallocated.

One ``BoundedLayer`` per model layer, plugged into transformers as a ``Cache``; each holds the
``HeadGroup``s of its KV heads (``kvtool/core/storage.py``: one registry of per-token buffers).
Uniform policies use one group holding every KV head. RazorAttention uses one group for its
retrieval heads (long capacity) and one for the other heads (sinks + window + compensation), so
the bytes allocated are the sum of the groups' capacities and each group's attention is exact over
its own tokens.

This module owns what spans groups: the step counter (``seen``: tokens fed so far, what
``get_seq_length`` reports), the protection rule (sinks, recent windows, the pinned question,
recalled tokens), the eviction hook transformers' attention calls (``kvtool/core/evict.py`` does the
step), compact positions (``kvtool/core/positions.py``'s ``CompactPositions``), citation mass, and
snapshots. Eviction keeps the top-``capacity`` tokens per head, order preserved.
"""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor
from transformers.cache_utils import Cache, CacheLayerMixin

from kvtool.config import batch_split
from kvtool.core.column_sums import default_form
from kvtool.core.contract import GroupSpec, ScoreContext
from kvtool.core.evict import evict_step, protection_rank
from kvtool.core.positions import CompactPositions, Rotator
from kvtool.core.quant import KVCodec, Scratch
from kvtool.core.stacks import Stack, evict_stack, stack_layout
from kvtool.core.storage import LAZY_GROUP_BYTES, LAZY_START_SLOTS, HeadGroup, free_device_bytes
from kvtool.core.timing import SectionTimer

__all__ = ["LAZY_GROUP_BYTES", "LAZY_START_SLOTS", "BoundedCache", "BoundedLayer", "CacheCounters", "HeadGroup",
           "StepInfo", "free_device_bytes"]


@dataclass
class CacheCounters:
    """Running totals for stats and the dashboard (seconds: ``BoundedCache.timer``)."""

    evicted_tokens: int = 0  # summed over layers and KV heads
    prob_rows: int = 0  # attention-probability rows computed (per layer)
    max_cached: int = 0  # largest per-head length right after an eviction step (≤ capacity)
    max_stored: int = 0  # largest per-head length ever held: the block or lazy decode tokens included


class BoundedLayer(CacheLayerMixin):
    """One model layer: its head groups plus the hooks transformers calls."""

    is_compileable = False
    is_sliding = False

    def __init__(self, owner: BoundedCache, layer_idx: int, groups: list[HeadGroup]) -> None:
        super().__init__()
        # a weak reference: a strong one makes cache → layers → layer → cache a cycle, and a read's
        # cache (a dense one is hundreds of MB) would outlive its last use until Python's cyclic GC
        # happens to run
        self._owner = weakref.ref(owner)
        self.layer_idx = layer_idx
        self.groups = groups
        self.is_initialized = True

    @property
    def owner(self) -> BoundedCache:
        owner = self._owner()
        assert owner is not None, "a layer used after its cache was freed"
        return owner

    # transformers' CacheLayerMixin API --------------------------------------------------------
    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:  # buffers are preallocated
        pass

    def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        owner = self.owner
        step = owner.step
        for g in self.groups:
            if g.length == 0:
                g.rotary_floor = owner.rope.first_rotary(owner.seen)
            g.append(key_states, value_states, step.original_positions, step.rotary_positions)
        if self.groups[0].codec is not None:  # kvtool's attention reads the groups itself: no decode here
            return key_states, value_states
        return self.groups[0].kv()

    def get_seq_length(self) -> int:
        """Tokens *seen* (drives default positions), not tokens stored."""
        return self.owner.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """Tokens *stored* (plus the incoming block): the attention function masks each group itself."""
        return max(g.length for g in self.groups) + query_length, 0

    def get_max_length(self) -> int:
        caps = [g.capacity for g in self.groups]
        return -1 if any(c is None for c in caps) else max(caps)  # type: ignore[type-var]

    def reset(self) -> None:
        for g in self.groups:
            g.reset()

    # eviction ----------------------------------------------------------------------------------
    def after_attention(self, g: HeadGroup, probs: Tensor | None) -> None:
        """Let the group's policy observe the block; evict down to capacity now, or with the other layers of
        its stack at the end of the block (``BoundedCache.evict_deferred``: one gather for every layer)."""
        owner = self.owner
        evicting = g.evicts_now(owner.lazy, owner.lazy_limit)
        if g.policy.observe_every_step:  # running state sees every block, as the layer's attention ends
            t0 = owner.timer.start()
            g.policy.observe(owner.observation(self.layer_idx, g, probs))
            owner.timer.stop("score", t0)
        if not evicting:
            owner.rope.after_evict(g, False, owner.step.length)
            return
        owner.counters.max_stored = max(owner.counters.max_stored, g.length)
        if not owner.defer(g, probs):
            self.evict(g, probs)

    def evict(self, g: HeadGroup, probs: Tensor | None) -> None:
        """Bring ``g`` down to its capacity now (archiving what it drops when recall is on)."""
        owner = self.owner
        c = owner.counters
        archive = owner.archive_dropped if g.archive is not None and owner.pin_start is None else None
        dropped = evict_step(g, self.context(g, probs), archive, owner.timer)
        c.evicted_tokens += dropped * g.num_heads
        c.max_cached = max(c.max_cached, g.length)
        t0 = owner.timer.start()
        owner.rope.after_evict(g, True, owner.step.length)
        owner.timer.stop("evict", t0)

    def context(self, g: HeadGroup, probs: Tensor | None, evicting: bool = True) -> ScoreContext:
        """What the group's policy sees this step; the protection only when it evicts (a step that only
        observes, H2O's on every decoded token, would build a dozen [h, n] masks for nothing)."""
        owner = self.owner
        n = g.length
        keys, values = g.kv()
        pos = g.positions[:, :n]
        cap = g.capacity if g.capacity is not None else n
        protected, priority = owner.protection(pos, g) if evicting else (None, None)
        return ScoreContext(
            layer_idx=self.layer_idx,
            heads=g.heads,
            keys=keys[0, :, g.off :],
            values=values[0, :, g.off :],
            positions=pos,
            query_positions=owner.step_original_positions,
            probs=probs,
            state=g.state_views(),
            protected=protected,
            priority=priority,
            capacity=cap,
            block_len=owner.step_len,
            seen=owner.seen,
        )


class QuerySink(Protocol):
    """Where the attention function records a layer's queries while recall's question is fed (``recall.QueryLog``)."""

    def append(self, entry: tuple[int, Tensor, float]) -> None: ...


@dataclass
class StepInfo:
    """What the attention function needs to know about the block being fed."""

    length: int = 0
    original_positions: Tensor | None = None  # [m] stream positions of the block's tokens
    rotary_positions: Tensor | None = None  # [m] positions RoPE uses for the block (== original in absolute mode)
    masks: dict[tuple[int, ...], Tensor] = field(default_factory=dict)


class BoundedCache(Cache):
    """A transformers ``Cache`` whose layers never hold more than their capacity per KV head."""

    def __init__(
        self,
        layer_specs: list[list[GroupSpec]],
        *,
        num_kv_heads: int,
        num_attention_heads: int,
        head_dim: int,
        block_size: int,
        sinks: int,
        recent: int,
        dtype: torch.dtype,
        device: torch.device,
        positions_mode: str = "absolute",
        max_positions: int | None = None,
        rotator: Rotator | None = None,
        sync_timing: bool = False,
        codec: KVCodec | None = None,
    ) -> None:
        q_per_kv = num_attention_heads // num_kv_heads
        layers = []
        # coded K/V (``--kv-dtype``) are decoded into one scratch shared by every group: layers read in turn
        self.kv_scratch = Scratch(dtype, device)
        stacked = stack_layout(layer_specs) if codec is None else {}
        for idx, specs in enumerate(layer_specs):
            groups = [HeadGroup(s, num_kv_heads, q_per_kv, head_dim, block_size, dtype, device, codec,
                                stack=stacked.get((idx, gi))) for gi, s in enumerate(specs)]
            for g in groups:  # Gemma 3: local and global layers rotate with different RoPE bases
                g.rotator = rotator.for_layer(idx) if rotator is not None else None
                g.scratch = self.kv_scratch
            layers.append(BoundedLayer(self, idx, groups))
        super().__init__(layers=layers)
        members: dict[int, list[HeadGroup]] = {}
        for layer in layers:
            for g in layer.groups:
                if g.stack is not None:
                    members.setdefault(id(g.stack), []).append(g)
        self.stacks = [Stack(gs[0].stack, gs) for gs in members.values()]
        self._stack_of = {id(g): st for st in self.stacks for g in st.groups}
        self._layer_of = {id(g): layer for layer in layers for g in layer.groups}
        self._empty = torch.empty(0, device=device)  # what an observation context holds for keys and values
        # where a policy reads every row's probabilities only summed (H2O), the output comes from SDPA's fused
        # kernel and the probabilities are computed for the sums alone (``core/attention.py``): on a GPU, where
        # memory traffic and not the product's FLOPs is the cost; a CPU keeps the one pass that gives both
        self.fused_output = device.type == "cuda"
        # where such a policy's block has at least ``column_sums.MIN_ROWS`` rows: the output and each row's
        # log-sum-exp from one fused forward, then the column sums key-major (``core/column_sums.py``), no
        # probability matrix at all; "triton" on CUDA where Triton imports, else None (the explicit path above)
        self.two_pass: str | None = default_form(device)
        self.num_kv_heads = num_kv_heads
        self.num_attention_heads = num_attention_heads
        self.head_dim = head_dim
        self.block_size = block_size
        self.sinks = sinks
        self.recent = recent
        self.dtype = dtype
        self.codec = codec
        self.device = device
        self.max_positions = max_positions
        self.rotator = rotator
        self.timer = SectionTimer(device, sync_timing)  # seconds per section: host clock, or device events
        self.rope = CompactPositions(positions_mode, max_positions, block_size, device)
        self.rope.start(self.groups())
        self.seen = 0
        self.pin_start: int | None = None  # stream position from which tokens are pinned (the question)
        self.pin_end: int | None = None  # first position after the pinned question (the answer is not pinned)
        # Decoding evicts lazily (``Engine.generate`` sets this): tokens fill the spare block region
        # and one eviction per block of tokens brings the group back to capacity.
        self.lazy = False
        self.mass_gate: Tensor | None = None  # citing: [1], 1 until the decoder closes it on an end token
        self.counters = CacheCounters()
        self.step = StepInfo()
        self.query_log: QuerySink | None = None  # recall: gets (layer, queries, scaling) from the attention function
        self._scratch: dict[str, Tensor] = {}  # reused per-layer work buffers, by name (``buffer``)
        # recall (kvtool/core/recall.py): the archives' shared append buffers and the finalizer that closes
        # their files, both kept here so that a cache reused for another document (``clear``) replaces them
        self.archive_work: Any = None
        self.archive_closer: weakref.finalize | None = None
        self._blank = self.snapshot()  # the state ``clear`` goes back to (no tokens: a few empty tensors)

    def scratch(self, *shape: int) -> Tensor:
        """A float32 buffer of ``shape`` for one layer's attention probabilities, reused by every layer.

        One growing storage instead of a fresh ``[h, rows, n]`` tensor per layer and block: a large
        allocation per call costs page faults on CPU (the allocator returns it to the system) and
        allocator traffic on CUDA. It grows only when a longer row is needed (the cache filling up,
        or the dense reference's growing ``n``), so its size is one layer's probabilities, as before.
        Valid until the next call: the attention function consumes it within the layer.
        """
        return self.buffer("probs", torch.float32, *shape)

    def buffer(self, name: str, dtype: torch.dtype, *shape: int) -> Tensor:
        """A reused buffer of ``shape`` for work within one layer (``scratch``'s rule), one storage per name."""
        numel = math.prod(shape)
        store = self._scratch.get(name)
        if store is None or store.numel() < numel or store.dtype != dtype:
            store = self._scratch[name] = torch.empty(numel, dtype=dtype, device=self.device)
        return store[:numel].view(shape)

    def batch_split(self, batch: int, rows: int) -> int:
        """``batch_split`` for this device's threads: 1 on accelerators, whose batched matmuls balance themselves."""
        return batch_split(batch, torch.get_num_threads(), rows) if self.device.type == "cpu" else 1

    # -- counters -------------------------------------------------------------------------------
    @property
    def step_original_positions(self) -> Tensor:
        assert self.step.original_positions is not None
        return self.step.original_positions

    @property
    def step_len(self) -> int:
        return self.step.length

    def groups(self) -> list[HeadGroup]:
        return [g for layer in self.layers for g in layer.groups]  # type: ignore[attr-defined]

    def lengths(self) -> list[int]:
        return [g.length for g in self.groups()]

    def allocated_bytes(self) -> int:
        """K/V buffers (scales and original keys included) and, for coded K/V, the decode scratch."""
        return sum(g.allocated_bytes() for g in self.groups()) + self.kv_scratch.nbytes()

    @property
    def kv_dtype(self) -> str:
        """How K/V are stored: the codec's name, else the compute dtype's."""
        return self.codec.name if self.codec is not None else str(self.dtype).removeprefix("torch.")

    def kv_bytes_per_token(self) -> int:
        """Bytes of K+V one token takes in every layer and KV head, as stored (scales included)."""
        return sum(2 * g.bytes_per_token_head() * g.num_heads for g in self.groups())

    def stored_bytes(self) -> int:
        return sum(g.stored_bytes() for g in self.groups())

    def promised_bytes(self) -> int | None:
        """K/V bytes the budget promises: Σ over groups of heads × (capacity + compensation slot)."""
        total = 0
        for g in self.groups():
            p = g.promised_tokens()
            if p is None:
                return None
            total += p * g.num_heads * 2 * g.bytes_per_token_head()
        return total

    # -- protection --------------------------------------------------------------------------------
    def protected_mask(self, pos: Tensor, g: HeadGroup) -> Tensor:
        """Sinks, the recent window (engine's and the policy's), and pinned tokens."""
        return self.protection(pos, g)[0]

    def protection(self, pos: Tensor, g: HeadGroup) -> tuple[Tensor, Tensor]:
        """The protected tokens [h, n] and their priority [h, n] (int32, or int64 past 2^28 tokens: ``keep_top``).

        Grades, highest kept first when protected tokens exceed a head's capacity: sinks (oldest
        first), the pinned question and recalled tokens, the recent window (engine's and the
        policy's ``protected_recent``), then what the policy protects itself (``extra_protected``,
        graded in ``evict.evict_step``); within a grade the newest first. Distinct per head.
        """
        cap = g.capacity if g.capacity is not None else g.length
        recent = max(self.recent, g.policy.protected_recent(cap))
        end = self.seen + self.step.length  # tokens seen once this block is in
        sinks = pos < self.sinks
        newest = pos >= end - recent
        pinned = torch.zeros_like(sinks)
        if self.pin_start is not None:
            pinned = pos >= self.pin_start
            pinned = pinned if self.pin_end is None else pinned & (pos < self.pin_end)
        if g.recalled is not None:  # recalled for this answer: a sorted search per head, no host sync
            at = torch.searchsorted(g.recalled, pos.contiguous()).clamp_(max=g.recalled.shape[1] - 1)
            pinned = pinned | (g.recalled.gather(1, at) == pos)
        mask = sinks | newest | pinned
        return mask, protection_rank(pos, sinks, pinned, newest, end)

    @property
    def lazy_limit(self) -> int:
        return self.rope.lazy_limit

    def room(self) -> int:
        """Tokens every group can still take before one must evict (lazy decoding leaves less)."""
        return min(g.room() for g in self.groups())

    def quiet_steps(self) -> int:
        """Single-token lazy steps from now on that evict in no group (``Engine.generate`` reads the answer back
        before a step that evicts: no eviction ever runs on account of a token past the answer's end)."""
        return min(g.quiet_steps(self.lazy_limit) for g in self.groups())

    # -- positions (kvtool/core/positions.py) ------------------------------------------------------
    @property
    def positions_mode(self) -> str:
        return self.rope.mode

    @property
    def compact(self) -> bool:
        """Whether stored keys are at compact positions now."""
        return self.rope.compact

    @property
    def compact_since(self) -> int | None:
        return self.rope.since

    @property
    def rotary_next(self) -> int:
        """Compact mode: the rotary position of the next token."""
        return self.rope.next

    @property
    def position_limit(self) -> int:
        return self.rope.limit

    @property
    def host_reads(self) -> bool:
        """Whether re-packing may read tensor data on the host (CPU: free; an accelerator: a sync)."""
        return self.rope.host_reads

    @host_reads.setter
    def host_reads(self, value: bool) -> None:
        self.rope.host_reads = value

    def begin_step(self, m: int) -> Tensor:
        """Prepare a block of ``m`` tokens; returns the rotary position ids to give the model."""
        original = torch.arange(self.seen, self.seen + m, device=self.device)
        rotary = self.rope.begin(self.groups(), self.seen, m)
        self.step = StepInfo(length=m, original_positions=original,
                             rotary_positions=rotary if self.rope.compact else original)
        return rotary

    def end_step(self) -> None:
        self.evict_deferred()
        self.seen += self.step.length
        if self.rope.compact:
            self.rope.next += self.step.length
        lengths = self.lengths()
        settled = [g.length for g in self.groups() if g.capacity is None or g.length <= g.capacity]
        if settled:  # a group holding lazily decoded tokens counts as stored, not as settled
            self.counters.max_cached = max(self.counters.max_cached, max(settled))
        self.counters.max_stored = max(self.counters.max_stored, max(lengths))

    # -- eviction (kvtool/core/evict.py does the step) ------------------------------------------------------
    def observation(self, layer_idx: int, g: HeadGroup, probs: Tensor | None) -> ScoreContext:
        """What a policy observes right after a layer's attention (``Policy.observe``): probabilities, state,
        positions; no keys, values or protection (built only when a block evicts)."""
        n = g.length
        return ScoreContext(layer_idx=layer_idx, heads=g.heads, keys=self._empty, values=self._empty,
                            positions=g.positions[:, :n], query_positions=self.step_original_positions, probs=probs,
                            state=g.state_views(), protected=self._empty, capacity=g.capacity or n,
                            block_len=self.step.length, seen=self.seen)

    def defer(self, g: HeadGroup, probs: Tensor | None) -> bool:
        """Leave ``g``'s eviction to the block's end, with the other layers of its stack; False when it
        must evict now (no stack, or state only this group holds: recalled tokens, citation mass)."""
        st = self._stack_of.get(id(g))
        if st is None or g.recalled is not None or g.mass is not None or not st.policy.batchable:
            return False
        stacked = st.keep_probs(st.groups.index(g), probs, self.step.length)
        st.pending.append(g)
        g.deferred_probs = stacked
        return True

    def evict_deferred(self) -> None:
        """Evict the groups whose eviction was left to the block's end: a whole stack at once when every
        layer of it evicts (one score, one top-k, one gather per buffer for all layers), else one by one."""
        for st in self.stacks:
            if not st.pending:
                continue
            pending, st.pending = st.pending, []
            lengths = {g.length for g in pending}
            if len(pending) == len(st.groups) and len(lengths) == 1:
                evict_stack(self, st)
                continue
            for g in pending:  # layers out of step: each alone, with the probabilities it stashed
                stacked, g.deferred_probs = g.deferred_probs, None
                self._layer_of[id(g)].evict(g, None if stacked is None else stacked[st.groups.index(g)])

    # -- attention mass (citations) ----------------------------------------------------------------------
    def start_mass(self, first_layer: int = 0) -> None:
        """Accumulate, from now on, the attention every stored token receives from single-token steps.

        Each group of layers ``first_layer..`` gets a float32 buffer beside its K/V (moved with eviction
        like policy state); the attention function adds the decode query's probabilities, summed over
        the group's query heads. Off (the default) costs nothing: the attention function only checks
        ``mass is None``.
        """
        for layer in self.layers[first_layer:]:
            for g in layer.groups:  # type: ignore[attr-defined]
                g.start_mass()
        self.mass_gate = torch.ones(1, dtype=torch.float32, device=self.device)

    @property
    def citing(self) -> bool:
        return self.mass_gate is not None

    def close_mass_on(self, token: Tensor, end_ids: Tensor) -> None:
        """Add no more mass once ``token`` [1] (on the device, not read back) is one of ``end_ids``: the steps a
        decoder feeds past the answer's end before it reads it back leave the citations as they were."""
        assert self.mass_gate is not None
        self.mass_gate.mul_(~torch.isin(token, end_ids))

    def stop_mass(self) -> tuple[Tensor, Tensor]:
        """Stop accumulating; returns (positions, mass) of every stored token, flat over layers, groups, heads."""
        pos, mass = [], []
        for g in self.groups():
            if g.mass is not None:
                pos.append(g.positions[:, : g.length].reshape(-1))
                mass.append(g.mass[:, : g.length].reshape(-1))
            g.stop_mass()
        self.mass_gate = None
        if not pos:
            return torch.zeros(0, dtype=torch.long), torch.zeros(0)
        return torch.cat(pos), torch.cat(mass)

    def archive_dropped(self, g: HeadGroup, dropped: Tensor) -> None:
        """Append tokens ``dropped`` [h, k] (indices into the stored ones) to the group's archive, keys at
        their original positions; gathered into the archive's append buffers (nothing allocated per block)."""
        assert g.archive is not None
        h, k, d = dropped.shape[0], dropped.shape[1], g.head_dim
        stored = g.stored_values()
        buf = functools.partial(g.archive.work.get, device=stored.device)  # gathered into the append's buffers
        positions = torch.gather(g.positions[:, : g.length], 1, dropped, out=buf("positions", (h, k), torch.long))
        values = torch.gather(stored, 1, dropped.unsqueeze(-1).expand(-1, -1, d), out=buf("values", (h, k, d),
                                                                                            stored.dtype))
        keys = self.rope.original_keys(g, dropped, positions, buf("keys", (h, k, d), stored.dtype),
                                       buf("delta", (h, k), torch.long))
        g.archive.append(keys, values, positions)

    # -- snapshots and persistence ------------------------------------------------------------------
    def state_dict(self, origin: bool = False) -> dict[str, Tensor]:
        """Every group's persisted buffers, contiguous copies (``origin``: with the original keys' copy)."""
        out: dict[str, Tensor] = {}
        for li, layer in enumerate(self.layers):
            for gi, g in enumerate(layer.groups):  # type: ignore[attr-defined]
                out.update(g.state_dict(f"l{li}.g{gi}", origin))
        return out

    def saved_views(self, origin: bool = False) -> Iterator[tuple[str, Tensor]]:
        """``state_dict``'s names and tensors as views of the buffers, group by group (nothing copied)."""
        for li, layer in enumerate(self.layers):
            for gi, g in enumerate(layer.groups):  # type: ignore[attr-defined]
                yield from g.saved_views(f"l{li}.g{gi}", origin)

    def scalars(self) -> dict[str, Any]:
        return {"seen": self.seen, **self.rope.state(), "pin_start": self.pin_start, "pin_end": self.pin_end}

    @torch.inference_mode()
    def load(self, tensors: dict[str, Tensor], scalars: dict[str, Any]) -> None:
        for li, layer in enumerate(self.layers):
            for gi, g in enumerate(layer.groups):  # type: ignore[attr-defined]
                g.load_state_dict(tensors, f"l{li}.g{gi}")
        self.seen = int(scalars["seen"])
        self.rope.load(scalars, self.groups())
        self.pin_start = scalars.get("pin_start")
        self.pin_end = scalars.get("pin_end")

    def snapshot(self, store: dict[str, Tensor] | None = None) -> tuple[dict[str, Tensor], dict[str, Any]]:
        """A copy of the stored tokens and counters (e.g. after the document, before a question), the original
        keys' copy of compact positions included: a restore gives back the very keys the document left.

        On a GPU the copy lives in pinned host memory: it is as large as the cache, and a GPU's memory is what
        bounds the budget; a restore copies it back, once per question. ``store``: flat buffers kept from an
        earlier snapshot, written over and grown in place (the copy is then valid until the next one): a run
        over many documents makes this, a read's largest allocation, once instead of once per document.

        Each buffer is copied straight from the cache into its storage, one at a time: on a CPU nothing else is
        allocated; on a GPU the copy to the host makes one layer's buffer contiguous on the device first (the
        memory plan's ``snapshot_bytes`` there)."""
        pinned = self.device.type == "cuda"
        store = {} if store is None else store
        out = {}
        for key, t in self.saved_views(origin=True):
            buf = store.get(key)
            if buf is None or buf.numel() < t.numel() or buf.dtype != t.dtype:
                buf = store[key] = torch.empty(t.numel(), dtype=t.dtype, device="cpu" if pinned else t.device,
                                               pin_memory=pinned)
            out[key] = buf[: t.numel()].view(t.shape).copy_(t)
        return out, self.scalars()

    def restore(self, snap: tuple[dict[str, Tensor], dict[str, Any]]) -> None:
        self.load(*snap)

    def clear(self) -> None:
        """Empty the cache for another document: exactly a new cache's state, its first K/V buffers kept.

        One run over many documents then allocates its K/V buffers once (the process does not grow from
        document to document), and nothing of a document reaches the next one, whether it was answered or
        failed anywhere (in a layer's forward, halfway through a block): the stacks' deferred evictions and
        stashed probabilities, recall's extra capacity and slots (the K/V bytes are a new cache's again),
        pins, positions, citation mass, counters and timings all go. Work buffers that hold no state (one
        layer's probabilities, the archive's append buffers, the stacks' score rows) are kept at the largest
        size a document needed: made again for every document, they made the process's RSS creep (freed and
        re-made blocks fragment the CPU allocator's heap). The archive is the engine's to close and renew
        (``Engine.reuse_cache``).
        """
        for st in self.stacks:
            st.reset()
        self.restore(self._blank)
        self.kv_scratch = Scratch(self.dtype, self.device)  # counted in ``allocated_bytes``: sized by the slots
        for g in self.groups():  # the slots a group started with: what recall or a long document grew goes back
            g.stop_mass()
            g.deferred_probs = None
            g.scratch = self.kv_scratch
            if g.slots != g.start_slots:
                g.buffers.renew(g.start_slots)
        self.counters = CacheCounters()
        self.timer.reset()
        self.step = StepInfo()
        self.lazy = False
        self.query_log = None
        self.mass_gate = None
        self.rope.host_reads = self.device.type == "cpu"
