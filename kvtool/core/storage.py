"""Head-group storage: one registry of per-token buffers, moved together by append, gather, permute, grow.

Layout (one ``HeadGroup`` per group of KV heads of a layer that share a capacity)::

    buffers (TokenBuffers: name -> tensor, token axis, leading fixed slots)
      keys, values   [h, off + slots, d]   post-RoPE keys (off = 1: RazorAttention's compensation slot)
      positions      [h, slots]            int64, original stream position of each token
      rotary         [h, slots]            int64, the RoPE position each stored key holds now
      state          [F, h, slots]         float32, the policy's per-token running state
      mass           [h, slots]            float32, attention received while citing (registered on demand)
      origin         [h, slots, d]         keys at their original position (compact positions, narrow K/V only)
      key_scale, value_scale, origin_scale  [h, off + slots]  float16, one per token (int8 / int4 K/V only)

With ``--kv-dtype`` other than the compute dtype (``kvtool/core/quant.py``) keys, values and origin hold
codes (a narrower float, or int8 / int4 with a per-token scale); every reader goes through ``kv()``,
``stored_keys()``, ``stored_values()`` or ``origin_keys()``, which decode into the cache's shared scratch,
and every writer through ``_write``, ``write_keys`` or ``_set_lead``, which encode. int4 also keeps its newest
tokens in 16 bits (``quant.RecentWindow``, outside the registry: indexed by position, not slot), which those
readers write over the decoded codes.

Every per-token tensor lives in the registry (``kvtool/core/buffers.py``), so eviction, recall's merge, growth
and ``.kvc`` loading move all of them with the same index; a new per-token buffer is one ``add`` call.
Within a group every head holds the same number of tokens, so no ragged masks are needed.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from kvtool.core.archive import GroupArchive, dropped_indices
from kvtool.core.buffers import LayerStack, TokenBuffers
from kvtool.core.contract import GroupSpec, Policy
from kvtool.core.costs import slot_head_bytes
from kvtool.core.positions import Rotator
from kvtool.core.quant import SCALE_DTYPE, KVCodec, RecentWindow, Scratch
from kvtool.errors import UsageError

#: a head group whose full buffers would exceed this starts small and grows (see ``HeadGroup.__init__``)
LAZY_GROUP_BYTES = 256 * 1024 * 1024
LAZY_START_SLOTS = 4096
#: buffers a ``.kvc`` file and a snapshot hold (the others are derived or transient)
PERSISTED = ("keys", "values", "positions", "rotary", "state")
#: the scale buffer of each coded K/V buffer (int8 / int4)
SCALES = {"keys": "key_scale", "values": "value_scale", "origin": "origin_scale"}
#: buffers an in-memory snapshot holds beside ``PERSISTED`` and a ``.kvc`` does not (a load rebuilds them)
SNAPSHOT_ONLY = ("origin", "origin_scale")


def file_tensors(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """The tensors of a cache snapshot that a ``.kvc`` file holds (``SNAPSHOT_ONLY`` buffers left out)."""
    return {k: v for k, v in tensors.items() if k.rsplit(".", 1)[-1] not in SNAPSHOT_ONLY}


def free_device_bytes(device: torch.device) -> int | None:
    """Memory the device can still give (CUDA: free memory; CPU: MemAvailable), None when unknown."""
    if device.type == "cuda":  # the driver's free memory and what torch's allocator holds but does not use
        free = torch.cuda.mem_get_info(device)[0]
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _check_free(g: HeadGroup, new_slots: int, recalled: int = 0) -> None:
    """Refuse a growth to ``new_slots`` the device cannot hold: what the resize allocates (every buffer it reallocates,
    every layer of a stack), beside the old buffers it frees only after the copy."""
    need = g.buffers.resize_bytes(new_slots)
    free = free_device_bytes(g.device)
    if free is not None and need > free:
        if recalled:
            raise UsageError(
                f"recalling {recalled:,} tokens per head needs {need / 2**30:.1f} GiB of new buffers, but {g.device} "
                f"has {free / 2**30:.1f} GiB free; lower the recall", field="recall")
        raise UsageError(
            f"the KV cache needs {need / 2**30:.1f} GiB of new buffers for {new_slots:,} tokens per head, but "
            f"{g.device} has {free / 2**30:.1f} GiB free; lower the budget or the block size", field="budget")


class HeadGroup:
    """Storage for the KV heads of one layer that share a capacity and a policy."""

    def __init__(self, spec: GroupSpec, num_kv_heads: int, q_per_kv: int, head_dim: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, codec: KVCodec | None = None,
                 stack: tuple[LayerStack, int] | None = None) -> None:
        """``stack``: (the stack, this group's layer in it) when the group shares its buffers with groups of
        the same layout in the other layers (``kvtool/core/buffers.py``), which are then evicted together."""
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
        self.device = device
        self.head_dim = head_dim
        self.dtype = dtype  # the compute dtype: what attention, scores and the archive read
        self.codec = codec  # how K/V are stored (None: in ``dtype``)
        self.scratch: Scratch | None = None  # where coded K/V are decoded (BoundedCache shares one)
        h = len(self.heads)
        self.recent = RecentWindow(h, codec.window, head_dim, dtype, device) if codec and codec.window else None
        # What the run may need is capacity + one block; buffers start there unless that is large, then they
        # start small and double up to it as tokens arrive: a budget or block far above the document's length
        # allocates only what the document fills (growth happens a few times per run, never per token).
        self.max_slots = None if self.capacity is None else self.capacity + block_size
        self.block_size = block_size
        per_slot = h * slot_head_bytes(self.bytes_per_token_head(), len(self.state_fields))
        slots = 4 * block_size + block_size if self.max_slots is None else self.max_slots
        if slots * per_slot > LAZY_GROUP_BYTES:
            slots = min(slots, LAZY_START_SLOTS)
        self.stack = stack[0] if stack is not None else None
        # the stack's probabilities this group's eviction reads, when it was left to the block's end
        self.deferred_probs: Tensor | None = None
        self.buffers = TokenBuffers(slots) if stack is None else stack[0].registry(stack[1], slots)
        self.start_slots = slots  # what ``BoundedCache.clear`` gives back (recall and lazy growth make more)
        for name in ("keys", "values"):
            self._add_coded(name, self.off, shared=True)
        self.persisted = PERSISTED + (("key_scale", "value_scale") if codec is not None and codec.integer else ())
        self.buffers.add("positions", (h,), (), torch.long, device, shared=True)
        self.buffers.add("rotary", (h,), (), torch.long, device, shared=True)
        self.buffers.add("state", (len(self.state_fields), h), (), torch.float32, device, shared=True)
        self.length = 0
        # Lowest RoPE position any stored key holds, as a Python int (compact re-packing reads it on
        # every step; reading it from ``rotary`` would be a host sync per layer). Exact while the
        # first token is a sink; a lower bound otherwise (which only re-packs earlier).
        self.rotary_floor = 0
        # compensation token (RazorAttention eq. 4): running sums of dropped keys/values in float32
        self.comp_key_sum = torch.zeros(h, head_dim, dtype=torch.float32, device=device) if self.off else None
        self.comp_value_sum = torch.zeros_like(self.comp_key_sum) if self.off else None
        self.comp_count = 0

    # -- buffer views (the registry's tensors; keys/values with a leading batch axis) --------------
    @property
    def keys(self) -> Tensor:
        """The raw key buffer [1, h, off + slots, d'] (codes under ``--kv-dtype``: read through ``kv()``)."""
        return self.buffers["keys"].unsqueeze(0)

    @property
    def values(self) -> Tensor:
        return self.buffers["values"].unsqueeze(0)

    @property
    def positions(self) -> Tensor:
        return self.buffers["positions"]

    @property
    def rotary(self) -> Tensor:
        return self.buffers["rotary"]

    @property
    def state(self) -> Tensor:
        return self.buffers["state"]

    @property
    def mass(self) -> Tensor | None:
        """Attention mass per stored token while an answer is decoded with citations (None: not citing)."""
        return self.buffers["mass"] if "mass" in self.buffers else None

    @property
    def origin(self) -> Tensor | None:
        """Keys at their original positions [h, slots, d] (compact positions in 16 bits), else None."""
        return self.buffers["origin"] if "origin" in self.buffers else None

    def start_mass(self) -> None:
        """Register (or zero) the citation-mass buffer."""
        if "mass" in self.buffers:
            self.buffers["mass"].zero_()
        else:
            self.buffers.add("mass", (self.num_heads,), (), torch.float32, self.device)

    def stop_mass(self) -> None:
        self.buffers.remove("mass")

    def keep_origin(self) -> None:
        """Keep each key at its original position beside the rotated one (a 16-bit cache in compact mode),
        so a re-pack rotates from the model's own key and rounds once, not once per re-pack."""
        if "origin" in self.buffers or self.buffers["keys"].element_size() >= 4:
            return
        self._add_coded("origin", 0)
        n = self.length
        if n:
            keys = self.stored_keys()
            if self.rotator is not None:
                keys = self.rotator.rotate(keys, self.positions[:, :n] - self.rotary[:, :n])
            self._put("origin", 0, keys)

    # -- coded K/V (kvtool/core/quant.py) -------------------------------------------------------
    def _add_coded(self, name: str, lead: int, shared: bool = False) -> None:
        """Register a [h, lead + slots, d] K/V buffer in the storage format, with its scale when integer
        (``shared``: in the layer stack, when the group has one)."""
        c, h = self.codec, (self.num_heads,)
        if c is None:
            self.buffers.add(name, h, (self.head_dim,), self.dtype, self.device, lead=lead, shared=shared)
            return
        self.buffers.add(name, h, (c.tail(self.head_dim),), c.storage_dtype, self.device, lead=lead, shared=shared)
        if c.integer:
            self.buffers.add(SCALES[name], h, (), SCALE_DTYPE, self.device, lead=lead, shared=shared)

    def _coded_names(self, name: str) -> tuple[str, ...]:
        """Buffer ``name`` and, when the codes are integer, its scale's buffer."""
        return (name, SCALES[name]) if self.codec is not None and self.codec.integer else (name,)

    def _put(self, name: str, start: int, x: Tensor) -> None:
        """Overwrite tokens ``start`` … of buffer ``name`` (and its scale) with ``x`` [h, m, d], encoded in place."""
        m = x.shape[1]
        views = [self.buffers.items[key].tokens(start, start + m) for key in self._coded_names(name)]
        self._encode(x, *views)

    def _set_lead(self, name: str, x: Tensor) -> None:
        """Write the compensation slot of ``name`` (keys or values) from ``x`` [h, d], encoded."""
        views = [self.buffers[key].narrow(1, 0, 1) for key in self._coded_names(name)]
        self._encode(x.to(self.dtype).unsqueeze(1), *views)

    def _encode(self, x: Tensor, data: Tensor, scale: Tensor | None = None) -> None:
        if self.codec is None:
            data.copy_(x)
        else:
            self.codec.encode_into(x, data, scale, self._shared(), chunk=self.block_size)

    def _decoded(self, name: str, start: int, stop: int, out: Tensor) -> Tensor:
        """Buffer ``name``'s raw slots ``start`` … ``stop`` − 1 (leading slots counted) decoded into ``out``."""
        assert self.codec is not None
        data = self.buffers[name][:, start:stop]
        scale = self.buffers[SCALES[name]][:, start:stop] if self.codec.integer else None
        work = self.scratch.work(out.shape) if self.scratch is not None and self.codec.integer else None
        self.codec.decode(data, scale, out, work, self.scratch)
        if self.recent is not None:  # the window's tokens among them read their 16-bit copy
            lead = 0 if name == "origin" else self.off
            a, b = max(start - lead, stop - lead - self._window_span(), 0), stop - lead
            if b > a:  # keys at compact positions (with "origin" kept) turn from their original ones
                shift = self.rotary[:, a:b] - self.positions[:, a:b] if "origin" in self.buffers else None
                rotate = self.rotator.rotate if self.rotator is not None else None
                self.recent.overlay(name, out[:, out.shape[1] - (b - a):], self.positions[:, a:b], shift, rotate,
                                    self._shared())
        return out

    def _window_span(self) -> int:
        """The newest stored slots among which int4's window tokens are (matched there by position): the
        window's size, and the tokens recalled for this answer, which a relevance placement puts after the
        kept ones (the document's newest tokens then sit that many slots further from the end)."""
        assert self.recent is not None
        return self.recent.size + (0 if self.recalled is None else self.recalled.shape[1])

    def _shared(self) -> Scratch:
        """The cache's shared decode scratch (a group used alone makes its own)."""
        if self.scratch is None:
            self.scratch = Scratch(self.dtype, self.device)
        return self.scratch

    def _scratch(self) -> tuple[Tensor, Tensor]:
        """The shared decode buffers viewed as [h, off + slots, d] for this group."""
        return self._shared().views(self.num_heads, self.off + self.slots, self.head_dim)

    def stored_values(self) -> Tensor:
        """The stored values [h, length, d] as attention reads them (compensation slot excluded)."""
        if self.codec is None:
            return self.buffers.items["values"].tokens(0, self.length)
        a, b = self.off, self.off + self.length
        return self._decoded("values", a, b, self._scratch()[1][:, a:b])

    def origin_keys(self, n: int) -> Tensor | None:
        """The first ``n`` original-position keys [h, n, d] as read back, or None without them."""
        if "origin" not in self.buffers:
            return None
        if self.codec is None:
            return self.buffers.items["origin"].tokens(0, n)
        return self._decoded("origin", 0, n, self._scratch()[0][:, self.off : self.off + n])

    def write_keys(self, keys: Tensor) -> None:
        """Overwrite the first ``keys.shape[1]`` stored keys with ``keys`` [h, e, d] (re-rotated), encoded.

        Integer codes round the rotated key again, so the policy's per-token constants of those tokens
        (KeyDiff's key norm) are computed again from what attention now reads.
        """
        self._put("keys", 0, keys)
        if self.codec is not None and self.codec.integer and self.state_fields:
            self._refresh_constants(0, keys.shape[1])

    def bytes_per_token_head(self) -> int:
        """Bytes of one token's key (or value) in one head as stored, its scale included."""
        if self.codec is None:
            return self.head_dim * self.dtype.itemsize
        return self.codec.bytes_per_token_head(self.head_dim)

    # -- sizes --------------------------------------------------------------------------------
    @property
    def num_heads(self) -> int:
        return len(self.heads)

    @property
    def slots(self) -> int:
        return self.buffers.slots

    def allocated_bytes(self) -> int:
        """Bytes of the K/V buffers (scales included), and of the original keys' copy when the group keeps one."""
        names = ("keys", "values", "origin", *SCALES.values())
        coded = sum(self.buffers[n].numel() * self.buffers[n].element_size() for n in names if n in self.buffers)
        return coded + (self.recent.nbytes() if self.recent is not None else 0)

    def promised_tokens(self) -> int | None:
        """Tokens per head the budget promises for this group (compensation slot included; recall apart)."""
        return None if self.base_capacity is None else self.base_capacity + self.off

    def stored_bytes(self) -> int:
        """Bytes of K/V actually held (stored tokens, the compensation slot and int4's window)."""
        window = 0 if self.recent is None else 2 * self.recent.keys.numel() * self.recent.keys.element_size()
        return (self.length + self.off) * 2 * self.bytes_per_token_head() * self.num_heads + window

    # -- appending ----------------------------------------------------------------------------
    def grow(self, needed: int) -> None:
        """Enlarge the buffers (double, to at most ``max_slots``): the unbounded ``full`` group, or a large one.

        Before allocating, the new size is checked against the device's free memory: a plan that cannot fit
        is a one-line usage error with the figure, not an allocator failure or the OOM killer.
        """
        new_slots = max(needed, 2 * self.slots)
        if self.max_slots is not None:
            new_slots = min(new_slots, self.max_slots)
        _check_free(self, new_slots)
        self.buffers.resize(new_slots, self.length)

    def make_room(self, extra: int) -> None:
        """Slots for ``extra`` recalled tokens per head on top of capacity + block, grown when first needed.

        Recall sizes this by what the archive holds, never by the recall setting alone, so a recall far
        above the document allocates only what the document filled; a size the device cannot hold is
        a usage error with the figure.
        """
        if self.max_slots is None:
            return
        need = max(self.max_slots, (self.base_capacity or 0) + self.block_size + extra)
        self.max_slots = need
        # buffers preallocated to capacity + block grow to ``need`` at once; buffers still growing lazily
        # (a budget or block far above the document) grow by ``extra`` only, later appends grow them further
        target = min(need, self.slots + extra)
        if self.slots < target:
            _check_free(self, target, recalled=extra)
            self.buffers.resize(target, self.length)

    def append(self, key_states: Tensor, value_states: Tensor, positions: Tensor, rotary: Tensor | None = None) -> None:
        """Write a block's keys/values ([1, Hkv, m, d] for all KV heads of the layer)."""
        m = key_states.shape[2]
        if self.length + m > self.slots:
            if self.max_slots is not None and self.length + m > self.max_slots:
                raise RuntimeError(f"block of {m} tokens does not fit: capacity {self.capacity}, slots {self.slots}")
            self.grow(self.length + m)
        if not self.all_heads:
            key_states = key_states.index_select(1, self.kv_index)
            value_states = value_states.index_select(1, self.kv_index)
        keys, values = key_states[0], value_states[0]
        pos = positions.expand(self.num_heads, m)
        rot = (positions if rotary is None else rotary).expand(self.num_heads, m)
        original = keys
        if "origin" in self.buffers and self.rotator is not None:  # the model rotated the block to ``rot``
            original = self.rotator.rotate(keys, pos - rot)  # a zero delta leaves the key bit-identical
        self._write(keys, values, pos, rot, original=original, newest=True)

    def _write(self, keys: Tensor, values: Tensor, positions: Tensor, rotary: Tensor, original: Tensor,
               newest: bool = False) -> None:
        """Append tokens after the stored ones: [h, m, d] keys (rotated to ``rotary``), [h, m] positions;
        ``newest``: the stream's next tokens (not recalled ones), which enter the full-precision window."""
        n = self.length
        coded = {"keys": keys, "values": values, **({"origin": original} if "origin" in self.buffers else {})}
        for name, x in coded.items():  # encoded straight into their slots
            self._put(name, n, x)
        row: dict[str, Tensor | float] = {"positions": positions, "rotary": rotary}
        window = 0
        if newest and self.recent is not None:
            self.recent.record(original, values, positions, self._shared())
            window = self._window_span()
        row["state"] = self.new_state(keys, values)
        self.length += self.buffers.write(n, row, written={c for name in coded for c in self._coded_names(name)})
        if self.codec is not None and isinstance(row["state"], Tensor):  # tokens leaving the window included
            self._refresh_constants(max(0, n - window), self.length)

    def _refresh_constants(self, a: int, b: int) -> None:
        """Recompute the policy's per-token constants (KeyDiff's key norm, VATP's ‖v‖₁) of stored tokens
        ``a`` … ``b`` − 1 from the K/V attention reads now: scores see what attention sees."""
        lo, hi = self.off + a, self.off + b
        k, v = self._scratch()
        consts = self.policy.constants(self._decoded("keys", lo, hi, k[:, lo:hi]),
                                       self._decoded("values", lo, hi, v[:, lo:hi]))
        for name, value in consts.items():
            self.state[self.state_fields.index(name), :, a:b] = value

    def insert(self, keys: Tensor, values: Tensor, positions: Tensor, merge: bool = True) -> None:
        """Add tokens ([h, T, d] keys at their original ``positions`` [h, T]) to the stored ones: merged in
        position order, or (``merge=False``) after them in the order given; they count on top of the
        capacity until the next restore (recall's one entry)."""
        n, T = self.length, keys.shape[1]
        if T == 0:
            return
        if n + T > self.slots:
            raise RuntimeError(f"{T} recalled tokens do not fit: {n} stored, {self.slots} slots")
        dt = self.dtype
        keys, values, positions = keys.to(self.device, dt), values.to(self.device, dt), positions.to(self.device)
        self._write(keys, values, positions, positions, original=keys)
        if merge:
            self.buffers.permute(torch.argsort(self.positions[:, : n + T], dim=1, stable=True))
        if self.capacity is not None:
            self.capacity += T
        self.recalled = torch.sort(positions, dim=1).values  # protected until the next restore

    def new_state(self, keys: Tensor, values: Tensor) -> Tensor | float:
        """Policy state of tokens being stored ([h, m, d] keys/values) → ``[F, h, m]``.

        Running fields (H2O's sums) start at 0; per-token constants (``Policy.constants``: KeyDiff's
        inverse key norm, VATP's ‖v‖₁) are computed here, once per token, so scoring never recomputes
        them over the whole cache. A plain 0 when there are none.
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
        if self.capacity is None:
            return False
        return self.length >= (self._evicting_length(lazy_limit) if lazy else self.capacity + 1)

    def quiet_steps(self, lazy_limit: int) -> int:
        """Single-token lazy steps from now on for which ``evicts_now`` stays False (each adds one token)."""
        if self.capacity is None:
            return 1 << 62
        return max(0, self._evicting_length(lazy_limit) - self.length - 1)

    def _evicting_length(self, lazy_limit: int) -> int:
        """The length at which a lazily decoding group evicts (``evicts_now``'s one rule)."""
        assert self.capacity is not None
        return max(self.capacity + 1, min(self.usable_slots, lazy_limit))

    @property
    def usable_slots(self) -> int:
        """Slots the group may fill: capacity + one block (its buffers may still be smaller and grow)."""
        return self.slots if self.max_slots is None else self.max_slots

    def room(self) -> int:
        """Tokens the group can still append without evicting (unbounded groups grow: no limit)."""
        return 1 << 62 if self.capacity is None else self.usable_slots - self.length

    # -- views ----------------------------------------------------------------------------------
    def kv(self) -> tuple[Tensor, Tensor]:
        """Keys/values the block's queries attend to: [1, h, off + length, d] (decoded when coded: valid
        until the next read of any group of the cache)."""
        end = self.off + self.length
        if self.codec is None:
            return self.keys[:, :, :end], self.values[:, :, :end]
        k, v = self._scratch()
        k, v = self._decoded("keys", 0, end, k[:, :end]), self._decoded("values", 0, end, v[:, :end])
        return k.unsqueeze(0), v.unsqueeze(0)

    def stored_keys(self) -> Tensor:
        """The stored keys [h, length, d] as attention reads them (a view, compensation slot excluded)."""
        if self.codec is None:
            return self.buffers.items["keys"].tokens(0, self.length)
        a, b = self.off, self.off + self.length
        return self._decoded("keys", a, b, self._scratch()[0][:, a:b])

    def comp_bias(self) -> float:
        """Logit bias of the compensation slot: log N_d (RazorAttention eq. 5), −inf when empty."""
        return math.log(self.comp_count) if self.comp_count > 0 else float("-inf")

    def rotate_compensation(self, rotator: Rotator | None, delta: int) -> None:
        """Move the compensation token by ``delta`` positions (compact mode keeps it near the window)."""
        if self.comp_key_sum is None or self.comp_count == 0 or delta == 0 or rotator is None:
            return
        d = torch.full((self.num_heads, 1), delta, device=self.comp_key_sum.device)
        self.comp_key_sum.copy_(rotator.rotate(self.comp_key_sum.unsqueeze(1), d).squeeze(1))
        self._set_lead("keys", self.comp_key_sum / self.comp_count)

    def state_views(self) -> dict[str, Tensor]:
        n = self.length
        return {name: self.state[i, :, :n] for i, name in enumerate(self.state_fields)}

    # -- eviction -------------------------------------------------------------------------------
    def gather(self, keep: Tensor) -> None:
        """Keep tokens ``keep`` ([h, c] sorted indices into the stored tokens), in place.

        One index per head moves every per-token buffer together; the dropped tokens feed the
        compensation token when the group has one.
        """
        c, n = keep.shape[1], self.length
        if self.comp_key_sum is not None and n > c:
            self._compensate(dropped_indices(keep, n))
        self.buffers.gather(keep, n)
        self.length = c

    def _compensate(self, dropped: Tensor) -> None:
        """Add the dropped tokens to the compensation sums, in float32 (eq. 4 as a running mean): "all
        minus kept" would subtract two large sums and lose the small difference to cancellation."""
        assert self.comp_key_sum is not None and self.comp_value_sum is not None
        idx = dropped.unsqueeze(-1).expand(-1, -1, self.head_dim)
        self.comp_key_sum += self.stored_keys().gather(1, idx).float().sum(1)
        self.comp_value_sum += self.stored_values().gather(1, idx).float().sum(1)
        self.comp_count += dropped.shape[1]
        self._set_lead("keys", self.comp_key_sum / self.comp_count)
        self._set_lead("values", self.comp_value_sum / self.comp_count)

    def reset(self) -> None:
        self.length = 0
        self.comp_count = 0
        if self.recent is not None:
            self.recent.reset()
        if self.comp_key_sum is not None and self.comp_value_sum is not None:
            self.comp_key_sum.zero_()
            self.comp_value_sum.zero_()

    # -- persistence -----------------------------------------------------------------------------
    def state_dict(self, prefix: str, origin: bool = False) -> dict[str, Tensor]:
        """The stored tokens' persisted buffers (``.kvc``), each a contiguous copy; ``origin``: also the original
        keys' copy and its scales, when the group keeps one (an in-memory snapshot: a restore then needs no rebuild)."""
        return {key: t.clone() if t.is_contiguous() else t.contiguous() for key, t in self.saved_views(prefix, origin)}

    def saved_views(self, prefix: str, origin: bool = False) -> list[tuple[str, Tensor]]:
        """``state_dict``'s tensors as views of the buffers (valid until the cache changes): a snapshot copies each
        into its own storage, so nothing holds a second copy of the cache while it is taken."""
        names = self.persisted + (self._coded_names("origin") if origin and "origin" in self.buffers else ())
        out = [(f"{prefix}.{name}", self.buffers.saved(name, self.length)) for name in names]
        if self.recent is not None:
            out += [(f"{prefix}.{name}", t) for name, t in self.recent.state().items()]
        if self.comp_key_sum is not None and self.comp_value_sum is not None:
            out += [(f"{prefix}.comp_key_sum", self.comp_key_sum), (f"{prefix}.comp_value_sum", self.comp_value_sum),
                    (f"{prefix}.comp_count", torch.tensor([self.comp_count], dtype=torch.long))]
        return out

    def _load_origin(self, tensors: dict[str, Tensor], prefix: str, n: int) -> None:
        """The original keys' copy as the snapshot held it, or none: a cache that compact positions need it for
        and a ``.kvc`` does not carry it rebuilds it from the keys once (``CompactPositions.start``).

        Rebuilding it on every restore instead rounded each key's original twice (from its rotated codes back,
        then again), and the question's re-pack rotated every kept key from that second rounding."""
        if f"{prefix}.origin" not in tensors:
            for name in self._coded_names("origin"):
                self.buffers.remove(name)
            return
        if "origin" not in self.buffers:
            self._add_coded("origin", 0)
        for name in self._coded_names("origin"):
            b = self.buffers[name]
            self.buffers.load(name, tensors[f"{prefix}.{name}"].to(b.device, b.dtype), n)

    def load_state_dict(self, tensors: dict[str, Tensor], prefix: str) -> None:
        keys = tensors[f"{prefix}.keys"]
        self.capacity = self.base_capacity
        self.max_slots = None if self.capacity is None else self.capacity + self.block_size  # recall's room back
        self.recalled = None
        n = keys.shape[1] - self.off
        stored = self.buffers["keys"]
        mismatch = keys.dtype != stored.dtype and not (keys.is_floating_point() and stored.is_floating_point())
        if mismatch or any(f"{prefix}.{s}" not in tensors for s in self.persisted):
            raise ValueError(f"{prefix}: K/V stored as {str(keys.dtype).removeprefix('torch.')}, this run stores "
                             f"them as {self.codec.name if self.codec else str(self.dtype).removeprefix('torch.')}")
        if keys.shape[0] != self.num_heads or keys.shape[-1] != stored.shape[-1]:
            raise ValueError(f"{prefix}: shape {tuple(keys.shape)} does not match this model's cache layout")
        if n > self.slots:
            if self.capacity is not None and n > self.capacity:
                raise ValueError(f"{prefix}: {n} tokens exceed the capacity {self.capacity}")
            self.grow(n)
        st = tensors[f"{prefix}.state"]
        if st.shape[0] != self.state.shape[0]:
            raise ValueError(f"{prefix}: policy state has {st.shape[0]} fields, expected {self.state.shape[0]}")
        for name in self.persisted:
            b = self.buffers[name]
            self.buffers.load(name, tensors[f"{prefix}.{name}"].to(b.device, b.dtype, non_blocking=True), n)
        self.length = n
        if self.recent is not None:
            self.recent.load({k: tensors[f"{prefix}.{k}"] for k in self.recent.state() if f"{prefix}.{k}" in tensors})
        if "mass" in self.buffers:
            self.buffers.items["mass"].tokens(0, n).zero_()
        self._load_origin(tensors, prefix, n)
        self.rotary_floor = int(self.rotary[:, 0].min()) if n else 0
        if self.comp_key_sum is not None and self.comp_value_sum is not None:
            self.comp_key_sum.copy_(tensors[f"{prefix}.comp_key_sum"])
            self.comp_value_sum.copy_(tensors[f"{prefix}.comp_value_sum"])
            self.comp_count = int(tensors[f"{prefix}.comp_count"][0])
