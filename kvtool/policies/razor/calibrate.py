"""Retrieval-head calibration for RazorAttention (Tang et al., §3.3, Table 2, §4.1.1).

The paper identifies *retrieval heads* with a data-free probe: K random tokens repeated 4 times are
fed to the model as one sequence, and for every (layer, query head)

* the **echo score** is the attention weight from a token of repeats 2..R to the previous
  occurrence of the same token (position ``i − K``);
* the **induction score** is the attention weight to the token that *followed* the previous
  occurrence (position ``i − K + 1``), i.e. the token an induction head would copy next.

Both are averaged over every query position of repeats 2..R. The top 14 % of heads by induction
score and the top 1 % by echo score are retrieval heads (their union). Under GQA a KV head is
retrieval if any of the query heads sharing it is (§4.1.1).

Memory: the attention probabilities are never materialised for the whole model. A custom attention
function registered through ``transformers.AttentionInterface`` computes each layer's normal
output (SDPA, or the model's own eager function when the model was loaded with eager attention)
and, on the fly, only the two needed diagonals of the probability matrix: for query rows processed
in chunks it computes the logits ``q_i·k_j`` for the full causal row (needed for the softmax
denominator), takes a logsumexp, and gathers the logits at ``j = i − K`` and ``j = i − K + 1``.
A chunk holds at most ``_CHUNK_ELEMENTS`` float32 logits (64 MiB), so peak extra memory is one
chunk, independent of the number of layers. The model's attention implementation is restored
afterwards.

Calibration results are cached as JSON under ``<home>/calibration/<identity[:16]>.json``.
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from kvtool.errors import KvtoolError, UsageError
from kvtool.fileio import read_capped

#: K used by the paper (§3.3).
PAPER_K = 2500
#: Default cap on the calibration sequence length (K × repeats) when the model is on CPU: the probe
#: costs O(L·H·T²) and 2048 tokens take seconds to a few minutes on CPU for small/medium models.
#: Pass ``K`` explicitly (or ``max_tokens``) to raise it; on accelerators the cap is not applied.
CPU_MAX_TOKENS = 2048
#: Largest number of float32 logits one chunk of query rows may hold while scoring (64 MiB).
_CHUNK_ELEMENTS = 1 << 24

FORMAT = "kvtool-calibration"
#: a calibration file holds two floats per head: a few hundred KiB for the largest models, never this much
MAX_CALIBRATION_BYTES = 64 << 20
FORMAT_VERSION = 1

_ATTN_NAME = "kvtool_calibrate"
_ACTIVE: dict[str, Any] | None = None  # state of the head_scores() call in progress


# --------------------------------------------------------------------------------------------------
# model config helpers
# --------------------------------------------------------------------------------------------------
def _text_config(model: Any) -> Any:
    cfg = model.config
    get = getattr(cfg, "get_text_config", None)
    return get() if callable(get) else cfg


def _model_dims(model: Any) -> tuple[int, int, int]:
    """(layers, query heads, KV heads) of the model's text stack."""
    cfg = _text_config(model)
    layers = int(cfg.num_hidden_layers)
    heads = int(cfg.num_attention_heads)
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    return layers, heads, int(kv)


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple, set)):
        return [int(v) for v in value if v is not None]
    return [int(value)]


def _model_device(model: Any) -> torch.device:
    try:
        return model.get_input_embeddings().weight.device
    except Exception:  # any model without a plain embedding
        return next(model.parameters()).device


def default_k(model: Any, repeats: int = 4, max_tokens: int | None = None) -> int:
    """The K used when none is given: ``min(2500, max_position_embeddings // repeats − 1, cap // repeats)``.

    ``cap`` is ``max_tokens`` if given, else ``CPU_MAX_TOKENS`` (2048) when the model lives on CPU
    and no cap otherwise. The −1 leaves room for the BOS token prepended to the probe.
    """
    if repeats < 2:
        raise UsageError(f"calibration needs repeats >= 2 (got {repeats})")
    cfg = _text_config(model)
    k = PAPER_K
    max_pos = getattr(cfg, "max_position_embeddings", None)
    if max_pos:
        k = min(k, int(max_pos) // repeats - 1)
    if max_tokens is None and _model_device(model).type == "cpu":
        max_tokens = CPU_MAX_TOKENS
    if max_tokens is not None:
        k = min(k, int(max_tokens) // repeats)
    if k < 2:
        raise UsageError(f"calibration needs K >= 2 random tokens; this model/cap only allows K={k}")
    return k


def probe_tokens(
    model: Any, K: int, repeats: int = 4, seed: int = 0, exclude_ids: Iterable[int] | None = None, bos: bool = True
) -> tuple[Tensor, int]:
    """The probe sequence ``[bos] + t_1..t_K repeated`` as [1, T] int64 and the offset of t_1 (0 or 1).

    Tokens are drawn uniformly from the vocabulary minus special tokens (config bos/eos/pad ids and
    ``exclude_ids``) with a ``torch.Generator`` seeded by ``seed``; they are distinct when the
    vocabulary allows (a uniform random subset), so "the previous occurrence" is unambiguous.
    """
    cfg = _text_config(model)
    vocab = int(cfg.vocab_size)
    try:
        vocab = min(vocab, int(model.get_input_embeddings().num_embeddings))
    except Exception:
        pass
    bos_ids = _ids(getattr(cfg, "bos_token_id", None))
    special = set(bos_ids) | set(_ids(getattr(cfg, "eos_token_id", None)))
    special |= set(_ids(getattr(cfg, "pad_token_id", None)))
    special |= set(int(i) for i in (exclude_ids or ()))
    allowed = torch.tensor([i for i in range(vocab) if i not in special], dtype=torch.long)
    if allowed.numel() < 2:
        raise UsageError("calibration: the vocabulary has fewer than 2 non-special tokens")
    gen = torch.Generator().manual_seed(int(seed))
    if K <= allowed.numel():
        pick = torch.randperm(allowed.numel(), generator=gen)[:K]
    else:
        pick = torch.randint(allowed.numel(), (K,), generator=gen)
    seq = allowed[pick].repeat(repeats)
    offset = 0
    if bos and bos_ids and 0 <= bos_ids[0] < vocab:
        seq = torch.cat([torch.tensor([bos_ids[0]]), seq])
        offset = 1
    return seq.unsqueeze(0), offset


# --------------------------------------------------------------------------------------------------
# scoring
# --------------------------------------------------------------------------------------------------
def scores_from_attention(attn: Tensor, K: int, repeats: int, offset: int = 0) -> tuple[Tensor, Tensor]:
    """Echo and induction scores [H] from full attention probabilities ``attn`` [H, T, T].

    Query rows are ``offset + K .. offset + repeats·K − 1`` (repeats 2..R); echo reads column
    ``i − K``, induction column ``i − K + 1``. Reference implementation (tests, tiny inputs).
    """
    H, T, _ = attn.shape
    if T < offset + repeats * K:
        raise ValueError(f"attention covers {T} tokens, the probe needs {offset + repeats * K}")
    rows = torch.arange(offset + K, offset + repeats * K)
    a = attn.float()
    echo = a[:, rows, rows - K].mean(-1)
    ind = a[:, rows, rows - K + 1].mean(-1)
    return echo, ind


def _diag_scores(
    query: Tensor,
    key: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None,
    K: int,
    start: int,
    stop: int,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Echo/induction scores [H] of one layer without materialising its [H, T, T] probabilities.

    ``query`` [1, H, T, d], ``key`` [1, Hkv, T', d] (post-RoPE, T' ≥ T). Rows ``start..stop−1``
    are processed in chunks: full causal logits of the chunk → logsumexp (the softmax denominator)
    → gather the two diagonals ``i − K`` and ``i − K + 1`` → probabilities.
    """
    q = query[0]
    k = key[0]
    H, T, d = q.shape
    Hkv = k.shape[0]
    g = H // Hkv
    scale = float(scaling) if scaling is not None else d**-0.5
    qg = q.reshape(Hkv, g, T, d)
    echo = torch.zeros(H, dtype=torch.float64, device=q.device)
    ind = torch.zeros(H, dtype=torch.float64, device=q.device)
    rows_per_chunk = max(1, _CHUNK_ELEMENTS // max(1, H * stop))
    for a in range(start, stop, rows_per_chunk):
        b = min(stop, a + rows_per_chunk)
        r = b - a
        logits = torch.matmul(qg[:, :, a:b].float(), k[:, None, :b].float().transpose(-1, -2))  # [Hkv,g,r,b]
        logits = logits.reshape(H, r, b) * scale
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        rows = torch.arange(a, b, device=q.device)
        if attention_mask is None:
            allowed = torch.arange(b, device=q.device)[None, :] <= rows[:, None]
            logits = logits.masked_fill(~allowed[None], float("-inf"))
        else:
            m = attention_mask[0, :, a:b, :b]
            if m.dtype == torch.bool:
                logits = logits.masked_fill(~m, float("-inf"))
            else:
                logits = logits + m.float()
        lse = torch.logsumexp(logits, dim=-1)  # [H, r]
        idx_e = (rows - K).view(1, r, 1).expand(H, r, 1)
        e = logits.gather(-1, idx_e).squeeze(-1)
        n = logits.gather(-1, idx_e + 1).squeeze(-1)
        echo += torch.exp(e - lse).sum(-1).double()
        ind += torch.exp(n - lse).sum(-1).double()
    count = max(1, stop - start)
    return (echo / count).float().cpu(), (ind / count).float().cpu()


def _calibration_attention(
    module: Any, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, *args: Any, **kwargs: Any
) -> tuple[Tensor, Any]:
    """Attention function registered as ``kvtool_calibrate``: normal output + on-the-fly scores."""
    state = _ACTIVE
    if state is None:  # used outside head_scores(): behave like the wrapped implementation
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, *args, **kwargs)
    out = state["inner"](module, query, key, value, attention_mask, *args, **kwargs)
    if query.shape[2] == state["T"] and key.shape[2] >= state["T"]:
        layer = getattr(module, "layer_idx", None)
        if layer is None:
            layer = state["calls"]
        state["calls"] += 1
        with torch.no_grad():
            e, n = _diag_scores(
                query.detach(),
                key.detach(),
                attention_mask,
                kwargs.get("scaling"),
                state["K"],
                state["start"],
                state["stop"],
                kwargs.get("softcap"),
            )
        state["results"][int(layer)] = (e, n)
        if state["progress"] is not None:
            state["progress"](len(state["results"]), state["num_layers"])
    return out


def _inner_attention(model: Any, original: str | None) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """(attention function, mask function) reproducing the model's original implementation."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    if original == "eager":
        # eager lives in each modeling file; softcapping models (Gemma 2) need it.
        eager = None
        for mod in model.modules():
            eager = getattr(sys.modules.get(type(mod).__module__), "eager_attention_forward", None)
            if eager is not None:
                break
        if eager is not None:
            return eager, ALL_MASK_ATTENTION_FUNCTIONS["eager"]
    return sdpa_attention_forward, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]


def head_scores(
    model: Any,
    K: int | None = None,
    repeats: int = 4,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
    *,
    max_tokens: int | None = None,
    exclude_ids: Iterable[int] | None = None,
    bos: bool = True,
) -> dict[str, Any]:
    """Echo and induction score of every (layer, query head) on the random-repeat probe.

    ``K`` defaults to :func:`default_k` (≤ 2500, fits ``max_position_embeddings``, and ≤ 2048 probe
    tokens on CPU unless ``max_tokens`` says otherwise); an explicit ``K`` is only checked against
    ``max_position_embeddings``. ``progress(done_layers, num_layers)`` is called once per layer.

    Returns ``{"K", "repeats", "seed", "bos", "tokens", "num_layers", "num_attention_heads",
    "num_kv_heads", "echo": [[float]*H]*L, "induction": [[float]*H]*L}``.
    """
    K = _probe_k(model, K, repeats, max_tokens)
    num_layers, num_heads, num_kv = _model_dims(model)
    ids, offset = probe_tokens(model, K, repeats, seed, exclude_ids, bos)
    results = _run_probe(model, ids, K=K, start=offset + K, stop=offset + repeats * K,
                         num_layers=num_layers, progress=progress)
    echo, ind = _score_lists(results, num_layers, num_heads)
    return {
        "K": K,
        "repeats": repeats,
        "seed": seed,
        "bos": offset == 1,
        "tokens": ids.shape[1],
        "num_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_kv_heads": num_kv,
        "echo": echo,
        "induction": ind,
    }


def _probe_k(model: Any, K: int | None, repeats: int, max_tokens: int | None) -> int:
    """The probe's span length ``K``: the default when not given, checked against the model's positions.

    A usage error when ``repeats < 2`` or ``K < 2`` (no repeat to score) or when the probe
    (``K × repeats`` plus BOS) would not fit ``max_position_embeddings``.
    """
    if repeats < 2:
        raise UsageError(f"calibration needs repeats >= 2 (got {repeats})")
    if K is None:
        K = default_k(model, repeats, max_tokens)
    K = int(K)
    if K < 2:
        raise UsageError(f"calibration needs K >= 2 random tokens (got {K})")
    max_pos = getattr(_text_config(model), "max_position_embeddings", None)
    if max_pos and K * repeats + 1 > int(max_pos):
        raise UsageError(
            f"calibration K={K} × repeats={repeats} exceeds the model's {max_pos} positions; "
            f"use K <= {int(max_pos) // repeats - 1}"
        )
    return K


def _run_probe(
    model: Any,
    ids: Tensor,
    *,
    K: int,
    start: int,
    stop: int,
    num_layers: int,
    progress: Callable[[int, int], None] | None,
) -> dict[int, tuple[Tensor, Tensor]]:
    """One forward pass of the probe with the scoring attention hooked in: ``{layer: (echo, induction)}``.

    The model's attention implementation, training flag and the module's active state are restored
    whatever happens; only the decoder stack runs, so no ``[T, vocab]`` logits are computed. An
    error when no layer reported (the model bypasses transformers' ``AttentionInterface``).
    """
    global _ACTIVE
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    original = getattr(model.config, "_attn_implementation", None)
    inner, mask_fn = _inner_attention(model, original)
    AttentionInterface.register(_ATTN_NAME, _calibration_attention)
    AttentionMaskInterface.register(_ATTN_NAME, mask_fn)
    results: dict[int, tuple[Tensor, Tensor]] = {}
    was_training = model.training
    if progress is not None:
        progress(0, num_layers)
    _ACTIVE = {
        "inner": inner,
        "T": ids.shape[1],
        "K": K,
        "start": start,
        "stop": stop,
        "results": results,
        "calls": 0,
        "progress": progress,
        "num_layers": num_layers,
    }
    try:
        model.set_attn_implementation(_ATTN_NAME)
        model.eval()
        body = getattr(model, "base_model", model)  # the decoder stack: no [T, vocab] logits
        with torch.no_grad():
            body(input_ids=ids.to(_model_device(model)), use_cache=False)
    finally:
        _ACTIVE = None
        model.set_attn_implementation(original or "sdpa")
        model.train(was_training)
    if not results:
        raise KvtoolError(
            "calibration: the model does not route attention through transformers' AttentionInterface; "
            "razor cannot calibrate it"
        )
    return results


def _score_lists(
    results: dict[int, tuple[Tensor, Tensor]], num_layers: int, num_heads: int
) -> tuple[list[list[float]], list[list[float]]]:
    """Per-layer lists of echo and induction scores; a layer that reported nothing scores zero."""
    echo: list[list[float]] = []
    ind: list[list[float]] = []
    for layer in range(num_layers):
        e, n = results.get(layer, (torch.zeros(num_heads), torch.zeros(num_heads)))
        echo.append([float(x) for x in e])
        ind.append([float(x) for x in n])
    return echo, ind


# --------------------------------------------------------------------------------------------------
# selection
# --------------------------------------------------------------------------------------------------
def head_count(frac: float, total: int) -> int:
    """How many heads a fraction selects: ``round(frac × total)`` (halves up), at least 1 when frac > 0."""
    if not 0.0 <= frac <= 1.0:
        raise UsageError(f"retrieval-head fraction {frac} must be between 0 and 1")
    if frac == 0.0:
        return 0
    return min(total, max(1, math.floor(frac * total + 0.5)))


def _top(scores: list[list[float]], n: int) -> list[tuple[int, int]]:
    flat = []
    for layer, row in enumerate(scores):
        for head, s in enumerate(row):
            s = float(s)
            flat.append((-(s if s == s else float("-inf")), layer, head))  # nan sorts last
    flat.sort()
    return [(layer, head) for _, layer, head in flat[:n]]


def select_retrieval_heads(
    scores: dict[str, Any],
    induction_frac: float = 0.14,
    echo_frac: float = 0.01,
    *,
    num_kv_heads: int | None = None,
    num_attention_heads: int | None = None,
) -> dict[str, Any]:
    """Pick retrieval heads: top induction ∪ top echo heads, mapped to KV heads (GQA rule, §4.1.1).

    ``scores`` holds ``"echo"`` and ``"induction"`` as [layer][query head] lists (``head_scores``).
    Counts use :func:`head_count` over all L × H query heads (ties broken by layer, then head).
    Query head q belongs to KV head ``q // (H / Hkv)``; a KV head is retrieval if any of its query
    heads is. Every layer appears in both maps (possibly with an empty list).
    """
    echo, ind = scores["echo"], scores["induction"]
    num_layers = len(ind)
    H = int(num_attention_heads or scores.get("num_attention_heads") or len(ind[0]))
    Hkv = int(num_kv_heads or scores.get("num_kv_heads") or H)
    if H % Hkv:
        raise UsageError(f"{H} query heads cannot be grouped into {Hkv} KV heads")
    group = H // Hkv
    total = num_layers * H
    ind_sel = _top(ind, head_count(induction_frac, total))
    echo_sel = _top(echo, head_count(echo_frac, total))
    query_heads: dict[int, list[int]] = {layer: [] for layer in range(num_layers)}
    for layer, head in sorted(set(ind_sel) | set(echo_sel)):
        query_heads[layer].append(head)
    kv_heads = {layer: sorted({h // group for h in hs}) for layer, hs in query_heads.items()}
    return {
        "query_heads": query_heads,
        "kv_heads": kv_heads,
        "induction_frac": induction_frac,
        "echo_frac": echo_frac,
        "induction_selected": [list(x) for x in ind_sel],
        "echo_selected": [list(x) for x in echo_sel],
    }


# --------------------------------------------------------------------------------------------------
# persistence
# --------------------------------------------------------------------------------------------------
def calibration_path(identity: str, home: Path) -> Path:
    return Path(home) / "calibration" / f"{identity[:16]}.json"


def save_calibration(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` as JSON atomically (temp file in the same folder + ``os.replace``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(data, fh, indent=1)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _head_map(value: Any, what: str) -> dict[int, list[int]]:
    if not isinstance(value, dict):
        raise ValueError(f"{what} is not a mapping")
    return {int(k): [int(h) for h in v] for k, v in value.items()}


def load_calibration(path: Path) -> dict[str, Any] | None:
    """The saved calibration, ``None`` if the file does not exist; a corrupt file is a KvtoolError."""
    path = Path(path)
    if not path.exists():
        return None
    try:
        text = read_capped(path, MAX_CALIBRATION_BYTES, "calibration file").decode("utf-8")
    except UsageError as exc:
        raise KvtoolError(str(exc)) from None
    except UnicodeDecodeError:
        raise KvtoolError(f"calibration file {path} is not UTF-8; delete it and calibrate again") from None
    try:
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError("not a kvtool calibration file")
        for key in ("identity", "K", "repeats", "seed", "induction_frac", "echo_frac", "echo", "induction"):
            if key not in data:
                raise ValueError(f"missing {key!r}")
        for key in ("echo", "induction"):
            rows = data[key]
            if not isinstance(rows, list) or not all(isinstance(r, list) for r in rows):
                raise ValueError(f"{key!r} is not a per-layer list")
            data[key] = [[float(x) for x in r] for r in rows]
        data["query_heads"] = _head_map(data.get("query_heads"), "query_heads")
        data["kv_heads"] = _head_map(data.get("kv_heads"), "kv_heads")
    except (ValueError, TypeError, AttributeError) as exc:
        reason = " ".join(str(exc).split()) or type(exc).__name__
        raise KvtoolError(f"calibration file {path} is corrupt ({reason}); delete it to recalibrate") from None
    return data


def calibrate(
    model: Any,
    identity: str,
    name: str,
    home: Path,
    K: int | None = None,
    induction_frac: float = 0.14,
    echo_frac: float = 0.01,
    force: bool = False,
    progress: Callable[[int, int], None] | None = None,
    *,
    repeats: int = 4,
    seed: int = 0,
    max_tokens: int | None = None,
    exclude_ids: Iterable[int] | None = None,
) -> dict[str, Any]:
    """Load the model's calibration from ``home`` if it matches, else compute it and save it.

    A saved file is reused when its identity, repeats and seed match and its K equals the requested
    K (or, when K is None, is at least :func:`default_k`: a longer probe is never worse). If only
    the fractions differ the heads are re-selected from the saved scores (no forward pass) and the
    file is updated. ``force`` recomputes regardless. ``exclude_ids`` (e.g. the tokenizer's
    ``all_special_ids``) are kept out of the random probe on top of the config's bos/eos/pad ids.
    Returns the saved dict (``kv_heads`` maps layer → KV heads).
    """
    head_count(induction_frac, 1)  # validate the fractions before any work
    head_count(echo_frac, 1)
    path = calibration_path(identity, home)
    want_k = int(K) if K is not None else default_k(model, repeats, max_tokens)
    data = None if force else load_calibration(path)
    if data is not None:
        same = data.get("identity") == identity and data.get("repeats") == repeats and data.get("seed") == seed
        k_ok = data.get("K") == want_k if K is not None else int(data.get("K", 0)) >= want_k
        if same and k_ok:
            if data.get("induction_frac") == induction_frac and data.get("echo_frac") == echo_frac:
                return data
            data.update(select_retrieval_heads(data, induction_frac, echo_frac))
            save_calibration(path, data)
            return data
    scores = head_scores(model, want_k, repeats, seed, progress, max_tokens=max_tokens, exclude_ids=exclude_ids)
    data = {"format": FORMAT, "version": FORMAT_VERSION, "model": name, "identity": identity, **scores}
    data.update(select_retrieval_heads(scores, induction_frac, echo_frac))
    save_calibration(path, data)
    return load_calibration(path) or data
