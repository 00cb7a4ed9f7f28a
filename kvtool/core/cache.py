"""The bounded KV cache: per layer, per group of KV heads, fixed capacity, preallocated.

Layout (one ``BoundedLayer`` per model layer, plugged into transformers as a ``Cache``)::

    layer.groups[g]                  heads: KV heads of the layer that share a capacity
      keys, values   [1, h, off + capacity + block, d]   preallocated, post-RoPE keys
      positions      [h, capacity + block]   int64, original stream position of each token
      rotary         [h, capacity + block]   int64, the RoPE position each stored key holds now
      state          [F, h, capacity + block] float32, the policy's per-token running state
      comp_*         (RazorAttention) one compensation slot at index 0 of keys/values (off = 1)

Uniform policies use one group holding every KV head. RazorAttention uses one group for its
retrieval heads (long capacity) and one for the other heads (sinks + window + compensation), so
the bytes allocated are the sum of the groups' capacities: per-head capacities save real memory,
and each group's attention is exact over its own tokens. Within a group every head holds the same
number of tokens (every head keeps exactly ``capacity``), so no ragged masks are needed.

Eviction keeps the top-``capacity`` tokens per head (order preserved) and moves K, V, positions and
state with one index per head, in place. The cache also owns the position counter: ``seen`` is the
number of tokens fed so far (what ``get_seq_length`` reports), and in ``compact`` position mode it
keeps keys rotated to their slot positions (see ``kvtool/core/positions.py``).
"""

from __future__ import annotations

import math
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from transformers.cache_utils import Cache, CacheLayerMixin

from kvtool.core.archive import GroupArchive, dropped_indices
from kvtool.core.contract import GroupSpec, Policy, ScoreContext
from kvtool.core.positions import Rotator
from kvtool.errors import UsageError

#: a head group whose full buffers would exceed this starts small and grows (see ``HeadGroup.__init__``)
LAZY_GROUP_BYTES = 256 * 1024 * 1024
LAZY_START_SLOTS = 4096


def free_device_bytes(device: torch.device) -> int | None:
    """Memory the device can still give (CUDA: free memory; CPU: MemAvailable), None when unknown."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _check_free(g: HeadGroup, new_slots: int) -> None:
    per_slot = g.num_heads * (2 * g.keys.shape[-1] * g.keys.element_size() + 16 + 4 * g.state.shape[0])
    need = (new_slots - g.slots) * per_slot
    free = free_device_bytes(g.keys.device)
    if free is not None and need > free:
        raise UsageError(
            f"the KV cache needs {need / 2**30:.1f} GiB more for {new_slots:,} tokens per head, but "
            f"{g.keys.device} has {free / 2**30:.1f} GiB free; lower --budget or --block-size"
        )


@dataclass
class CacheCounters:
    """Running totals for stats and the dashboard (seconds are wall-clock, synchronised on CUDA)."""

    evicted_tokens: int = 0  # summed over layers and KV heads
    prob_rows: int = 0  # attention-probability rows computed (per layer)
    probs_seconds: float = 0.0
    score_seconds: float = 0.0
    evict_seconds: float = 0.0
    max_cached: int = 0  # largest per-head length right after an eviction step (≤ capacity)
    max_stored: int = 0  # largest per-head length ever held: the block or lazy decode tokens included


class HeadGroup:
    """Storage for the KV heads of one layer that share a capacity and a policy."""

    def __init__(
        self,
        spec: GroupSpec,
        num_kv_heads: int,
        q_per_kv: int,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.heads = list(spec.heads)
        self.capacity = spec.capacity
        self.base_capacity = spec.capacity  # recall raises ``capacity`` for one answer; restore lowers it
        # Positions [h, T] (ascending) recalled for the current answer: kept until the next restore, so the
        # question and the answer displace the policy's own tokens, as without recall (core/recall.py)
        self.recalled: Tensor | None = None
        self.archive: GroupArchive | None = None  # where evicted tokens go (kvtool/core/archive.py)
        self.policy: Policy = spec.policy
        self.compensation = spec.compensation
        self.off = 1 if spec.compensation else 0
        self.window = spec.window  # sliding-window layer: tokens stay contiguous, masked by distance
        self.rotator: Rotator | None = None  # the layer's own RoPE (compact positions), set by BoundedCache
        self.all_heads = self.heads == list(range(num_kv_heads))
        self.kv_index = torch.tensor(self.heads, dtype=torch.long, device=device)
        q_idx = [h * q_per_kv + j for h in self.heads for j in range(q_per_kv)]
        self.q_index = torch.tensor(q_idx, dtype=torch.long, device=device)
        self.q_per_kv = q_per_kv
        self.state_fields: tuple[str, ...] = tuple(self.policy.state_fields)
        h = len(self.heads)
        # What the run may need is capacity + one block; buffers start there unless that is large, then they
        # start small and double up to it as tokens arrive: a budget or block far above the document's length
        # allocates only what the document fills (growth happens a few times per run, never per token).
        self.max_slots = None if self.capacity is None else self.capacity + block_size
        per_slot = h * (2 * head_dim * torch.empty((), dtype=dtype).element_size() + 16 + 4 * len(self.state_fields))
        slots = 4 * block_size + block_size if self.max_slots is None else self.max_slots
        if slots * per_slot > LAZY_GROUP_BYTES:
            slots = min(slots, LAZY_START_SLOTS)
        self.keys = torch.zeros(1, h, self.off + slots, head_dim, dtype=dtype, device=device)
        self.values = torch.zeros_like(self.keys)
        self.positions = torch.zeros(h, slots, dtype=torch.long, device=device)
        self.rotary = torch.zeros(h, slots, dtype=torch.long, device=device)  # RoPE position each key holds now
        self.state = torch.zeros(len(self.state_fields), h, slots, dtype=torch.float32, device=device)
        self.length = 0
        # Lowest RoPE position any stored key holds, as a Python int (compact re-packing reads it on
        # every step; reading it from ``rotary`` would be a host sync per layer). Exact while the
        # first token is a sink; a lower bound otherwise (which only re-packs earlier).
        self.rotary_floor = 0
        # compensation token (RazorAttention eq. 4): running sums of dropped keys/values in float32
        self.comp_key_sum = torch.zeros(h, head_dim, dtype=torch.float32, device=device) if self.off else None
        self.comp_value_sum = torch.zeros_like(self.comp_key_sum) if self.off else None
        self.comp_count = 0
        # attention mass per stored token while an answer is decoded with citations (None: not citing)
        self.mass: Tensor | None = None

    # -- sizes --------------------------------------------------------------------------------
    @property
    def num_heads(self) -> int:
        return len(self.heads)

    @property
    def slots(self) -> int:
        return self.positions.shape[1]

    def allocated_bytes(self) -> int:
        return 2 * self.keys.numel() * self.keys.element_size()

    def promised_tokens(self) -> int | None:
        """Tokens per head the budget promises for this group (compensation slot included; recall apart)."""
        return None if self.base_capacity is None else self.base_capacity + self.off

    def stored_bytes(self) -> int:
        """Bytes of K/V actually held (stored tokens and the compensation slot)."""
        per_token = 2 * self.keys.shape[-1] * self.keys.element_size() * self.num_heads
        return (self.length + self.off) * per_token

    # -- appending ----------------------------------------------------------------------------
    def _grow(self, needed: int) -> None:
        """Double the buffers (to at most ``max_slots``): the unbounded ``full`` group, or a very large one.

        Before allocating, the new size is checked against the device's free memory: a plan that cannot fit
        is a one-line usage error with the figure, not an allocator failure or the OOM killer.
        """
        new_slots = max(needed, 2 * self.slots)
        if self.max_slots is not None:
            new_slots = min(new_slots, self.max_slots)
        _check_free(self, new_slots)
        n = self.length
        keys = torch.zeros(1, self.num_heads, self.off + new_slots, self.keys.shape[-1], dtype=self.keys.dtype,
                           device=self.keys.device)
        values = torch.zeros_like(keys)
        keys[:, :, : self.off + n] = self.keys[:, :, : self.off + n]
        values[:, :, : self.off + n] = self.values[:, :, : self.off + n]
        positions = torch.zeros(self.num_heads, new_slots, dtype=torch.long, device=self.keys.device)
        positions[:, :n] = self.positions[:, :n]
        rotary = torch.zeros_like(positions)
        rotary[:, :n] = self.rotary[:, :n]
        self.rotary = rotary
        state = torch.zeros(self.state.shape[0], self.num_heads, new_slots, dtype=torch.float32,
                            device=self.keys.device)
        state[:, :, :n] = self.state[:, :, :n]
        self.keys, self.values, self.positions, self.state = keys, values, positions, state
        if self.mass is not None:
            mass = torch.zeros(self.num_heads, new_slots, dtype=torch.float32, device=self.keys.device)
            mass[:, :n] = self.mass[:, :n]
            self.mass = mass

    def append(self, key_states: Tensor, value_states: Tensor, positions: Tensor, rotary: Tensor | None = None) -> None:
        """Write a block's keys/values ([1, Hkv, m, d] for all KV heads of the layer)."""
        m = key_states.shape[2]
        if self.length + m > self.slots:
            if self.max_slots is not None and self.length + m > self.max_slots:
                raise RuntimeError(f"block of {m} tokens does not fit: capacity {self.capacity}, slots {self.slots}")
            self._grow(self.length + m)
        if not self.all_heads:
            key_states = key_states.index_select(1, self.kv_index)
            value_states = value_states.index_select(1, self.kv_index)
        a, b = self.off + self.length, self.off + self.length + m
        self.keys[:, :, a:b] = key_states
        self.values[:, :, a:b] = value_states
        self.positions[:, self.length : self.length + m] = positions
        self.rotary[:, self.length : self.length + m] = positions if rotary is None else rotary
        self.state[:, :, self.length : self.length + m] = self.new_state(self.keys[0, :, a:b], self.values[0, :, a:b])
        if self.mass is not None:
            self.mass[:, self.length : self.length + m] = 0
        self.length += m

    def new_state(self, keys: Tensor, values: Tensor) -> Tensor | float:
        """Policy state of tokens being stored ([h, m, d] keys/values) → ``[F, h, m]``.

        Running fields (H2O's sums) start at 0; per-token constants (``Policy.constants``: KeyDiff's
        inverse key norm, VATP's ‖v‖₁) are computed here, once per token, so scoring
        never recomputes them over the whole cache (issue 15). A plain 0 when there are none.
        """
        consts = self.policy.constants(keys, values) if self.state_fields else {}
        if not consts:
            return 0.0
        out = torch.zeros(len(self.state_fields), keys.shape[0], keys.shape[1], dtype=torch.float32,
                          device=keys.device)
        for name, value in consts.items():
            out[self.state_fields.index(name)] = value
        return out

    def evicts_now(self, lazy: bool, lazy_limit: int) -> bool:
        """Whether this step evicts: the group is over capacity and, while decoding lazily, its spare
        block region is full (one gather per block of generated tokens instead of one per token) or
        it holds ``lazy_limit`` tokens (compact positions must stay inside the model's range)."""
        if self.capacity is None or self.length <= self.capacity:
            return False
        return not lazy or self.length >= min(self.usable_slots, lazy_limit)

    @property
    def usable_slots(self) -> int:
        """Slots the group may fill: capacity + one block (its buffers may still be smaller and grow)."""
        return self.slots if self.max_slots is None else self.max_slots

    def room(self) -> int:
        """Tokens the group can still append without evicting (unbounded groups grow: no limit)."""
        return 1 << 62 if self.capacity is None else self.usable_slots - self.length

    # -- views ----------------------------------------------------------------------------------
    def kv(self) -> tuple[Tensor, Tensor]:
        """Keys/values the block's queries attend to: [1, h, off + length, d]."""
        end = self.off + self.length
        return self.keys[:, :, :end], self.values[:, :, :end]

    def comp_bias(self) -> float:
        """Logit bias of the compensation slot: log N_d (RazorAttention eq. 5), −inf when empty."""
        return math.log(self.comp_count) if self.comp_count > 0 else float("-inf")

    def rotate_compensation(self, rotator: Rotator | None, delta: int) -> None:
        """Move the compensation token by ``delta`` positions (compact mode keeps it near the window)."""
        if self.comp_key_sum is None or self.comp_count == 0 or delta == 0 or rotator is None:
            return
        d = torch.full((self.num_heads, 1), delta, device=self.comp_key_sum.device)
        self.comp_key_sum.copy_(rotator.rotate(self.comp_key_sum.unsqueeze(1), d).squeeze(1))
        self.keys[0, :, 0] = (self.comp_key_sum / self.comp_count).to(self.keys.dtype)

    def state_views(self) -> dict[str, Tensor]:
        n = self.length
        return {name: self.state[i, :, :n] for i, name in enumerate(self.state_fields)}

    # -- eviction -------------------------------------------------------------------------------
    def gather(self, keep: Tensor) -> None:
        """Keep tokens ``keep`` ([h, c] sorted indices into the stored tokens), in place.

        One index per head moves K, V, positions and state together; dropped tokens feed the
        compensation token when the group has one.
        """
        h, c = keep.shape
        n = self.length
        o = self.off
        d = self.keys.shape[-1]
        idx = keep.unsqueeze(-1).expand(h, c, d)
        k_all = self.keys[0, :, o : o + n]
        v_all = self.values[0, :, o : o + n]
        kept_k = k_all.gather(1, idx)
        kept_v = v_all.gather(1, idx)
        if self.comp_key_sum is not None and n > c:
            # The dropped tokens are summed themselves, in float32 (eq. 4 as a running mean): "all minus
            # kept" would subtract two large sums and lose the small difference to cancellation.
            dropped = torch.ones(h, n, dtype=torch.bool, device=keep.device).scatter_(1, keep, False)
            didx = dropped.nonzero()[:, 1].view(h, n - c).unsqueeze(-1).expand(h, n - c, d)
            self.comp_key_sum += k_all.gather(1, didx).float().sum(1)
            self.comp_value_sum += v_all.gather(1, didx).float().sum(1)
            self.comp_count += n - c
            self.keys[0, :, 0] = (self.comp_key_sum / self.comp_count).to(self.keys.dtype)
            self.values[0, :, 0] = (self.comp_value_sum / self.comp_count).to(self.values.dtype)
        self.keys[0, :, o : o + c] = kept_k
        self.values[0, :, o : o + c] = kept_v
        self.positions[:, :c] = self.positions[:, :n].gather(1, keep)
        self.rotary[:, :c] = self.rotary[:, :n].gather(1, keep)
        if self.state.shape[0]:
            sidx = keep.unsqueeze(0).expand(self.state.shape[0], h, c)
            self.state[:, :, :c] = self.state[:, :, :n].gather(2, sidx)
        if self.mass is not None:
            self.mass[:, :c] = self.mass[:, :n].gather(1, keep)
        self.length = c

    # -- persistence -----------------------------------------------------------------------------
    def state_dict(self, prefix: str) -> dict[str, Tensor]:
        n, o = self.length, self.off
        out = {
            f"{prefix}.keys": self.keys[0, :, : o + n].contiguous(),
            f"{prefix}.values": self.values[0, :, : o + n].contiguous(),
            f"{prefix}.positions": self.positions[:, :n].contiguous(),
            f"{prefix}.rotary": self.rotary[:, :n].contiguous(),
            f"{prefix}.state": self.state[:, :, :n].contiguous(),
        }
        if self.comp_key_sum is not None:
            out[f"{prefix}.comp_key_sum"] = self.comp_key_sum.clone()
            out[f"{prefix}.comp_value_sum"] = self.comp_value_sum.clone()
            out[f"{prefix}.comp_count"] = torch.tensor([self.comp_count], dtype=torch.long)
        return out

    def load_state_dict(self, tensors: dict[str, Tensor], prefix: str) -> None:
        keys = tensors[f"{prefix}.keys"]
        self.capacity = self.base_capacity
        self.recalled = None
        n = keys.shape[1] - self.off
        if keys.shape[0] != self.num_heads or keys.shape[-1] != self.keys.shape[-1]:
            raise ValueError(f"{prefix}: shape {tuple(keys.shape)} does not match this model's cache layout")
        if n > self.slots:
            if self.capacity is not None and n > self.capacity:
                raise ValueError(f"{prefix}: {n} tokens exceed the capacity {self.capacity}")
            self._grow(n)
        dev = self.keys.device
        self.keys[0, :, : self.off + n] = keys.to(dev, self.keys.dtype)
        self.values[0, :, : self.off + n] = tensors[f"{prefix}.values"].to(dev, self.values.dtype)
        self.positions[:, :n] = tensors[f"{prefix}.positions"].to(dev)
        self.rotary[:, :n] = tensors[f"{prefix}.rotary"].to(dev)
        st = tensors[f"{prefix}.state"]
        if st.shape[0] != self.state.shape[0]:
            raise ValueError(f"{prefix}: policy state has {st.shape[0]} fields, expected {self.state.shape[0]}")
        self.state[:, :, :n] = st.to(dev)
        self.rotary_floor = int(self.rotary[:, 0].min()) if n else 0
        if self.comp_key_sum is not None:
            self.comp_key_sum.copy_(tensors[f"{prefix}.comp_key_sum"])
            self.comp_value_sum.copy_(tensors[f"{prefix}.comp_value_sum"])
            self.comp_count = int(tensors[f"{prefix}.comp_count"][0])
        self.length = n


class BoundedLayer(CacheLayerMixin):
    """One model layer: its head groups plus the hooks transformers calls."""

    is_compileable = False
    is_sliding = False

    def __init__(self, owner: BoundedCache, layer_idx: int, groups: list[HeadGroup]) -> None:
        super().__init__()
        # a weak reference: a strong one makes cache → layers → layer → cache a cycle, and a read's
        # cache (a dense one is hundreds of MB) then outlives its last use until Python's cyclic GC
        # happens to run (measured: a 30-trial `eval needle` with `full` at 8K grew to 15 GB)
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
                g.rotary_floor = owner.rotary_next if owner.compact else owner.seen
            g.append(key_states, value_states, step.original_positions, step.rotary_positions)
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
            g.length = 0
            g.comp_count = 0
            if g.comp_key_sum is not None:
                g.comp_key_sum.zero_()
                g.comp_value_sum.zero_()

    # eviction ----------------------------------------------------------------------------------
    def after_attention(self, g: HeadGroup, probs: Tensor | None) -> None:
        """Let the group's policy observe the block, then evict down to capacity."""
        owner = self.owner
        evicting = g.evicts_now(owner.lazy, owner.lazy_limit)
        if not evicting and not g.policy.observe_every_step:
            owner.compact_group(g, evicted=False)
            return
        owner.counters.max_stored = max(owner.counters.max_stored, g.length)
        t0 = owner.clock()
        ctx = self.context(g, probs)
        extra = g.policy.extra_protected(ctx)
        if extra is not None:
            ctx.protected = ctx.protected | extra
        g.policy.observe(ctx)
        keep = g.policy.select(ctx) if evicting else None
        t1 = owner.clock()
        owner.counters.score_seconds += t1 - t0
        if keep is not None:
            owner.counters.evicted_tokens += (g.length - keep.shape[1]) * g.num_heads
            if g.archive is not None and owner.pin_start is None:
                owner.archive_dropped(g, keep)
            g.gather(keep)
            owner.counters.max_cached = max(owner.counters.max_cached, g.length)
        owner.compact_group(g, evicted=keep is not None)
        owner.counters.evict_seconds += owner.clock() - t1

    def context(self, g: HeadGroup, probs: Tensor | None) -> ScoreContext:
        owner = self.owner
        n = g.length
        keys, values = g.kv()
        pos = g.positions[:, :n]
        cap = g.capacity if g.capacity is not None else n
        return ScoreContext(
            layer_idx=self.layer_idx,
            heads=g.heads,
            keys=keys[0, :, g.off :],
            values=values[0, :, g.off :],
            positions=pos,
            query_positions=owner.step_original_positions,
            probs=probs,
            state=g.state_views(),
            protected=owner.protected_mask(pos, g),
            capacity=cap,
            block_len=owner.step_len,
            seen=owner.seen,
        )


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
    ) -> None:
        q_per_kv = num_attention_heads // num_kv_heads
        layers = []
        for idx, specs in enumerate(layer_specs):
            groups = [HeadGroup(s, num_kv_heads, q_per_kv, head_dim, block_size, dtype, device) for s in specs]
            for g in groups:  # Gemma 3: local and global layers rotate with different RoPE bases
                g.rotator = rotator.for_layer(idx) if rotator is not None else None
            layers.append(BoundedLayer(self, idx, groups))
        super().__init__(layers=layers)
        self.num_kv_heads = num_kv_heads
        self.num_attention_heads = num_attention_heads
        self.head_dim = head_dim
        self.block_size = block_size
        self.sinks = sinks
        self.recent = recent
        self.dtype = dtype
        self.device = device
        self.positions_mode = positions_mode  # "absolute" | "compact" | "auto"
        self.compact = positions_mode == "compact"  # whether keys are currently at compact positions
        self.compact_since: int | None = 0 if self.compact else None
        self.max_positions = max_positions
        self.rotator = rotator
        self.sync_timing = sync_timing and device.type == "cuda"
        # Whether the per-layer path may read tensor data on the host: free on CPU (no device queue
        # to wait for), a pipeline stall per layer on an accelerator (see ``_rotate``).
        self.host_reads = device.type == "cpu"
        self.seen = 0
        self.rotary_next = 0  # compact mode: rotary position of the next token
        self.pin_start: int | None = None  # stream position from which tokens are pinned (the question)
        self.pin_end: int | None = None  # first position after the pinned question (the answer is not pinned)
        # Decoding evicts lazily (``Engine.generate`` sets this): tokens fill the spare block region
        # and one eviction per block of tokens brings the group back to capacity.
        self.lazy = False
        self.counters = CacheCounters()
        self.step = StepInfo()
        self.query_log: list[tuple[int, Tensor, float]] | None = None  # recall: (layer, queries, scaling)
        self._scratch = torch.empty(0, dtype=torch.float32, device=device)

    def scratch(self, *shape: int) -> Tensor:
        """A float32 buffer of ``shape`` for one layer's attention probabilities, reused by every layer.

        One growing storage instead of a fresh ``[h, rows, n]`` tensor per layer and block: a large
        allocation per call costs page faults on CPU (the allocator returns it to the system) and
        allocator traffic on CUDA. It grows only when a longer row is needed (the cache filling up,
        or the dense reference's growing ``n``), so its size is one layer's probabilities, as before.
        Valid until the next call: the attention function consumes it within the layer.
        """
        numel = math.prod(shape)
        if numel > self._scratch.numel():
            self._scratch = torch.empty(numel, dtype=torch.float32, device=self.device)
        return self._scratch[:numel].view(shape)

    # -- clocks and counters -------------------------------------------------------------------
    def clock(self) -> float:
        if self.sync_timing:
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

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
        return sum(g.allocated_bytes() for g in self.groups())

    def stored_bytes(self) -> int:
        return sum(g.stored_bytes() for g in self.groups())

    def promised_bytes(self) -> int | None:
        """K/V bytes the budget promises: Σ over groups of heads × (capacity + compensation slot)."""
        total = 0
        for g in self.groups():
            p = g.promised_tokens()
            if p is None:
                return None
            total += p * g.num_heads * 2 * self.head_dim * g.keys.element_size()
        return total

    # -- protection --------------------------------------------------------------------------------
    def protected_mask(self, pos: Tensor, g: HeadGroup) -> Tensor:
        """Sinks, the recent window (engine's and the policy's), and pinned tokens."""
        cap = g.capacity if g.capacity is not None else g.length
        recent = max(self.recent, g.policy.protected_recent(cap))
        end = self.seen + self.step.length  # tokens seen once this block is in
        mask = (pos < self.sinks) | (pos >= end - recent)
        if self.pin_start is not None:
            pinned = pos >= self.pin_start
            mask |= pinned if self.pin_end is None else pinned & (pos < self.pin_end)
        if g.recalled is not None:  # recalled for this answer: a sorted search per head, no host sync
            at = torch.searchsorted(g.recalled, pos.contiguous()).clamp_(max=g.recalled.shape[1] - 1)
            mask |= g.recalled.gather(1, at) == pos
        return mask

    @property
    def lazy_limit(self) -> int:
        """Most tokens a group may hold while decoding lazily: with compact positions the next query
        must stay inside the model's range after a renormalisation (``renormalize``)."""
        return self.position_limit - 1 if self.positions_mode != "absolute" else 1 << 62

    def room(self) -> int:
        """Tokens every group can still take before one must evict (lazy decoding leaves less)."""
        return min(g.room() for g in self.groups())

    # -- positions -------------------------------------------------------------------------------
    def begin_step(self, m: int) -> Tensor:
        """Prepare a block of ``m`` tokens; returns the rotary position ids to give the model."""
        original = torch.arange(self.seen, self.seen + m, device=self.device)
        if not self.compact and self.positions_mode == "auto" and self.max_positions is not None:
            if self.seen + m > self.max_positions:
                self.switch_to_compact()
        if self.compact:
            if self.rotary_next + m > self.position_limit:
                self.renormalize()
            rotary = torch.arange(self.rotary_next, self.rotary_next + m, device=self.device)
        else:
            rotary = original
        self.step = StepInfo(length=m, original_positions=original, rotary_positions=rotary)
        return rotary

    def end_step(self) -> None:
        self.seen += self.step.length
        if self.compact:
            self.rotary_next += self.step.length
        lengths = self.lengths()
        settled = [g.length for g in self.groups() if g.capacity is None or g.length <= g.capacity]
        if settled:  # a group holding lazily decoded tokens counts as stored, not as settled
            self.counters.max_cached = max(self.counters.max_cached, max(settled))
        self.counters.max_stored = max(self.counters.max_stored, max(lengths))

    @property
    def position_limit(self) -> int:
        """Compact rotary positions stay below this (the trained range; 32K if the model does not say)."""
        return self.max_positions or 32768

    # Compact positions. Every key records the RoPE position it holds (``HeadGroup.rotary``). The
    # query position advances with every block like an absolute one, so an eviction only leaves
    # holes; a group is re-packed — its keys moved to ``next − len + r`` for rank r, right up to the
    # next query — once its holes exceed one block (``slack``). So no query ever sees a distance
    # above capacity + 2 blocks, and a re-pack rotates only the keys older than the newest hole
    # (with a sink + window policy: just the sinks). During decoding, one-token holes accumulate
    # for a block's worth of steps before one re-pack. When the next block would pass the model's
    # range, everything shifts down at once (``renormalize``): once every (range − capacity) tokens.

    def switch_to_compact(self) -> None:
        """Re-rotate every stored key from its original position to a packed compact position."""
        if self.rotator is None:
            raise RuntimeError("compact positions need a RoPE rotator")
        P = max(self.lengths())
        for g in self.groups():
            self._pack(g, P)
            g.rotate_compensation(g.rotator, P - self.seen)  # same frame shift as the query
        self.rotary_next = P
        self.compact = True
        self.compact_since = self.seen

    def renormalize(self) -> None:
        """Shift every rotary position down so the next query sits at the longest group's length."""
        assert self.rotator is not None
        shift = max(self.lengths()) - self.rotary_next
        if shift == 0:
            return
        for g in self.groups():
            n = g.length
            if n:
                self._rotate(g, torch.full((g.num_heads, n), shift, device=self.device))
                g.rotary[:, :n] += shift
            g.rotary_floor += shift
            g.rotate_compensation(g.rotator, shift)
        self.rotary_next += shift

    def compact_group(self, g: HeadGroup, evicted: bool) -> None:
        """After this step's eviction (compact mode): re-pack the group if its holes exceed the slack.

        The compensation token moves with the query, keeping its dropped keys at the distance they
        had when dropped.
        """
        if not self.compact:
            return
        m = self.step.length
        g.rotate_compensation(g.rotator, m)
        if not evicted or g.length == 0:
            return
        next_q = self.rotary_next + m  # the block's first rotary position is rotary_next (a Python int)
        if next_q - g.rotary_floor > g.length + self.block_size:
            self._pack(g, next_q)

    def _pack(self, g: HeadGroup, next_q: int) -> None:
        """Move the group's keys to ``next_q − len + r`` (rank r): RoPE rotations compose."""
        n = g.length
        if n == 0:
            return
        target = (next_q - n) + torch.arange(n, device=self.device)
        delta = target.unsqueeze(0) - g.rotary[:, :n]
        self._rotate(g, delta)
        g.rotary[:, :n] = target
        g.rotary_floor = next_q - n

    def _rotate(self, g: HeadGroup, delta: Tensor) -> None:
        """Rotate stored keys by ``delta`` [h, n] (a zero delta leaves a key bit-identical).

        With ``host_reads`` (CPU: the tensors are host memory, reading them stalls no device queue)
        only the prefix up to the last moved key is rotated — for a sink + window policy just the
        sinks. On an accelerator every stored key is rotated instead: finding the last moved one
        would be a host sync in every layer, and a re-pack happens at most once per block.
        """
        assert g.rotator is not None
        end = delta.shape[1]
        if self.host_reads:
            moved = (delta != 0).any(0).nonzero()
            if moved.numel() == 0:
                return
            end = int(moved[-1]) + 1
        keys = g.keys[0, :, g.off : g.off + end]
        keys.copy_(g.rotator.rotate(keys, delta[:, :end]))

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
                if g.mass is None or g.mass.shape[1] != g.slots:
                    g.mass = torch.zeros(g.num_heads, g.slots, dtype=torch.float32, device=self.device)
                else:
                    g.mass.zero_()

    def stop_mass(self) -> tuple[Tensor, Tensor]:
        """Stop accumulating; returns (positions, mass) of every stored token, flat over layers, groups, heads."""
        pos, mass = [], []
        for g in self.groups():
            if g.mass is not None:
                pos.append(g.positions[:, : g.length].reshape(-1))
                mass.append(g.mass[:, : g.length].reshape(-1))
            g.mass = None
        if not pos:
            return torch.zeros(0, dtype=torch.long), torch.zeros(0)
        return torch.cat(pos), torch.cat(mass)

    def archive_dropped(self, g: HeadGroup, keep: Tensor) -> None:
        """Append the tokens ``keep`` leaves out to the group's archive, keys at their original positions."""
        assert g.archive is not None
        n, o = g.length, g.off
        drop = dropped_indices(keep, n)
        idx = drop.unsqueeze(-1).expand(-1, -1, g.keys.shape[-1])
        keys = g.keys[0, :, o : o + n].gather(1, idx)
        values = g.values[0, :, o : o + n].gather(1, idx)
        pos = g.positions[:, :n].gather(1, drop)
        if self.compact:
            assert g.rotator is not None
            keys = g.rotator.rotate(keys, pos - g.rotary[:, :n].gather(1, drop))
        g.archive.append(keys, values, pos)

    # -- snapshots and persistence ------------------------------------------------------------------
    def state_dict(self) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        for li, layer in enumerate(self.layers):
            for gi, g in enumerate(layer.groups):  # type: ignore[attr-defined]
                out.update(g.state_dict(f"l{li}.g{gi}"))
        return out

    def scalars(self) -> dict[str, Any]:
        return {
            "seen": self.seen,
            "rotary_next": self.rotary_next,
            "compact": self.compact,
            "compact_since": self.compact_since,
            "pin_start": self.pin_start,
            "pin_end": self.pin_end,
            "positions_mode": self.positions_mode,
        }

    @torch.inference_mode()
    def load(self, tensors: dict[str, Tensor], scalars: dict[str, Any]) -> None:
        for li, layer in enumerate(self.layers):
            for gi, g in enumerate(layer.groups):  # type: ignore[attr-defined]
                g.load_state_dict(tensors, f"l{li}.g{gi}")
        self.seen = int(scalars["seen"])
        self.rotary_next = int(scalars.get("rotary_next", 0))
        self.compact = bool(scalars["compact"])
        self.compact_since = scalars.get("compact_since")
        self.pin_start = scalars.get("pin_start")
        self.pin_end = scalars.get("pin_end")

    def snapshot(self) -> tuple[dict[str, Tensor], dict[str, Any]]:
        """A copy of the stored tokens and counters (e.g. after the document, before a question)."""
        return {k: v.clone() for k, v in self.state_dict().items()}, self.scalars()

    def restore(self, snap: tuple[dict[str, Tensor], dict[str, Any]]) -> None:
        self.load(*snap)
