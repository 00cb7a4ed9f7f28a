"""Run settings: defaults, YAML profiles and CLI overrides merged into one validated ``Settings``.

Order of precedence (later wins): built-in defaults, then a profile, then options given on the
command line. Everything the user can get wrong is reported as a one-line ``UsageError`` that
names the offending field, so a typo in a profile never surfaces as a traceback deep in the engine.

Budgets are kept as text in ``Settings.budget`` because a byte budget ("2GiB") can only be turned
into tokens per head once the model's dimensions are known (``budget.resolve_budget_and_recall``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from kvtool.config import (
    ARCHIVE_DTYPES,
    DEFAULT_RECALL_PLACEMENT,
    DEVICE_HELP,
    DEVICE_RE,
    DTYPES,
    KV_DTYPES,
    QUANTIZE,
    RECALL_PLACEMENTS,
    profile_dirs,
)
from kvtool.errors import UsageError, shown
from kvtool.fileio import read_capped
from kvtool.numbers import LIMITS, capped
from kvtool.policy_syntax import check_spec
from kvtool.runtime.budget import Budget, parse_budget, parse_recall

POSITIONS = ("absolute", "compact", "auto")


@dataclass
class Settings:
    """Everything one run needs besides the document and the question.

    ``model=None`` means the embedded SmolLM2-135M-Instruct package. ``budget`` is text (see
    ``parse_budget``); ``policy_options`` are the raw ``key=value`` strings the policy parses itself.
    """

    model: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    quantize: str = "none"
    policy: str = "h2o"
    policy_options: dict[str, str] = field(default_factory=dict)
    budget: str = "1k"
    kv_dtype: str = "auto"  # how the cache stores K/V (auto: the model's dtype; int8 / int4 with scales)
    block_size: int | None = None  # None ("auto"): sized for the device and budget (``default_block_size``)
    sinks: int = 4
    recent: int = 8
    positions: str = "auto"
    recall: str = "auto"  # auto: ``ask`` recalls DEFAULT_RECALL tokens when the archive fits the disk
    recall_page: int = 32  # archive page size in tokens (the unit recall scores and brings back)
    recall_placement: str = DEFAULT_RECALL_PLACEMENT  # compact positions: recalled passages by relevance or in order
    archive_dtype: str = "int8"  # dtype of archived K/V (auto: the model's)
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    no_repeat_ngram: int = 4  # an answer never repeats a word n-gram of its own (0 = off)
    seed: int = 0
    threads: int | None = None  # intra-op CPU threads (None: the cores this process may run on)

    def validate(self) -> Settings:
        """Check every field's type and range; raise a one-line ``UsageError`` naming the field.

        Harmless type differences are normalised in place (``budget=4096`` becomes "4096",
        ``temperature=1`` becomes 1.0) so later code sees one type per field. Returns ``self``.
        """
        for f in fields(self):
            setattr(self, f.name, _FIELD_CHECKS[f.name](f.name, getattr(self, f.name)))
        return self

    @property
    def parsed_budget(self) -> Budget:
        """The budget as tokens or bytes (bytes still need the model's dimensions)."""
        return parse_budget(self.budget)


# ---------------------------------------------------------------------------------------------
# field checks shared by Settings.validate, profiles and CLI overrides
# ---------------------------------------------------------------------------------------------


def _number(key: str) -> Callable[[str, Any], Any]:
    """The check of a numeric setting: ``kvtool.numbers.capped`` against its range in ``LIMITS``."""
    rng = LIMITS[key]

    def check(name: str, value: Any) -> Any:
        return capped(name, value, rng)

    return check


def _choice(choices: tuple[str, ...]) -> Callable[[str, Any], str]:
    def check(name: str, value: Any) -> str:
        if not isinstance(value, str) or value not in choices:
            raise UsageError(f"{name} must be one of {', '.join(choices)}: got {shown(value)}")
        return value

    return check


def _threads(name: str, value: Any) -> int | None:
    return None if value is None else capped(name, value, LIMITS["threads"])


def _block(name: str, value: Any) -> int | None:
    """A block size, or ``auto`` (None): chosen for the device (``default_block_size``)."""
    if value is None or value == "auto":
        return None
    if isinstance(value, str) and value.strip().isdigit():  # the flag's text
        value = int(value)
    return capped(name, value, LIMITS["block_size"])


#: the smallest block ``auto`` feeds, and the block every evaluation table is read at (``kvtool eval`` on any
#: device: the tables stay comparable, docs/results.md)
TABLE_BLOCK = 128
#: the largest block a CPU read feeds by default
CPU_BLOCK = 256
#: the largest block a CUDA read feeds by default
GPU_BLOCK = 1024


def default_block_size(device_type: str, budget_tokens: int | None) -> int:
    """The block ``--block-size auto`` (the default) feeds on a device.

    The largest power of two that is at most a quarter of the budget (the cache holds budget + block, and a
    block's attention rows grow with it), between 128 and the device's largest:

    * a CPU: 256. Each block streams every weight from memory once, so 256 rows halve that traffic against
      128 while a block's keys grow by an eighth at budget 1K (4K tokens, budget 1K: the default ``ask`` read
      1.06–1.09× dense one pass at 256 against 0.96× at 128; docs/performance.md).
    * CUDA: 1,024. The model's own forward of a block is launch-bound until it is about a thousand tokens long
      (an H200, Llama-3.1-8B's shape: 6.4–7.0 ms for every block from 32 to 1,024 tokens, 11.6 ms at 2,048).
    """
    largest = GPU_BLOCK if device_type == "cuda" else CPU_BLOCK
    if budget_tokens is None:
        return largest
    quarter = max(1, budget_tokens // 4)
    return max(TABLE_BLOCK, min(largest, 1 << (quarter.bit_length() - 1)))


def _model(name: str, value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise UsageError(f"{name} must be a model path or name (or null for the embedded model): got {shown(value)}")
    # "~/models/..." in a profile means the user's home; no Hub id starts with "~".
    return os.path.expanduser(value) if value.startswith("~") else value


def _device(name: str, value: Any) -> str:
    if not isinstance(value, str) or not DEVICE_RE.match(value):
        raise UsageError(f"{name} must be {DEVICE_HELP}: got {shown(value)}")
    return value


def _policy(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise UsageError(f"{name} must be a policy name like keydiff or h2o+vatp: got {shown(value)}")
    check_spec(value)  # grammar and names, before torch is imported
    return value


def _scalar_text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _policy_options(name: str, value: Any) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise UsageError(f"{name} must be a mapping of option names to values: got {shown(value)}")
    out: dict[str, str] = {}
    for k, v in value.items():
        if not isinstance(k, str) or not k:
            raise UsageError(f"{name} keys must be option names: got {shown(k)}")
        if isinstance(v, (Mapping, list, tuple)) or v is None:
            raise UsageError(f"{name}.{k} must be a single value: got {shown(v)}")
        out[k] = _scalar_text(v)
    return out


def _budget(name: str, value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise UsageError(f"{name} must be a token count like 4096 or 4k, or a size like 512MiB: got {shown(value)}")
    parse_budget(value)  # its messages already start with "budget"
    return str(value).strip()


def _recall(name: str, value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise UsageError(f"{name} must be auto, off or a token count like 512 or 4k: got {shown(value)}")
    if str(value).strip().lower() == "auto":
        return "auto"
    return "off" if parse_recall(value) == 0 else str(value).strip()


# Each check returns the value coerced to the field's type (int budget -> "4096", 1 -> 1.0).
_FIELD_CHECKS: dict[str, Callable[[str, Any], Any]] = {
    "model": _model,
    "device": _device,
    "dtype": _choice(DTYPES),
    "quantize": _choice(QUANTIZE),
    "policy": _policy,
    "policy_options": _policy_options,
    "budget": _budget,
    "kv_dtype": _choice(KV_DTYPES),
    "block_size": _block,
    "sinks": _number("sinks"),
    "recent": _number("recent"),
    "positions": _choice(POSITIONS),
    "recall": _recall,
    "recall_page": _number("recall_page"),
    "recall_placement": _choice(RECALL_PLACEMENTS),
    "archive_dtype": _choice(ARCHIVE_DTYPES),
    "max_new_tokens": _number("max_new_tokens"),
    "temperature": _number("temperature"),
    "top_p": _number("top_p"),
    "repetition_penalty": _number("repetition_penalty"),
    "no_repeat_ngram": _number("no_repeat_ngram"),
    "seed": _number("seed"),
    "threads": _threads,
}

SETTINGS_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(Settings))
GENERATION_KEYS: tuple[str, ...] = ("max_new_tokens", "temperature", "top_p", "repetition_penalty",
                                     "no_repeat_ngram", "seed")
INFO_KEYS: tuple[str, ...] = ("description", "expected_memory", "requires_own_weights")
PROFILE_KEYS: tuple[str, ...] = (
    tuple(k for k in SETTINGS_FIELDS if k not in GENERATION_KEYS) + ("generation",) + INFO_KEYS
)


# ---------------------------------------------------------------------------------------------
# profiles
# ---------------------------------------------------------------------------------------------

#: a profile is a dozen lines; a larger file is refused unread (a 10 MB file of keys parses for minutes)
MAX_PROFILE_BYTES = 256 * 1024
#: YAML aliases a profile may use (``*name``): a few are handy, thousands are a "billion laughs"
MAX_YAML_ALIASES = 100
#: how deeply a profile's YAML may nest (a real one: three levels)
MAX_YAML_DEPTH = 32


def load_yaml(text: str, where: str) -> Any:
    """``yaml.safe_load`` with a cap on aliases and nesting; every failure is one ``UsageError`` line.

    Aliases expand by reference, so a "billion laughs" document is small in memory, but anything that
    walks it (a ``repr`` in an error message, a merge) does the billion steps: more than
    :data:`MAX_YAML_ALIASES` is refused while composing. Deep nesting is refused at :data:`MAX_YAML_DEPTH`,
    before the composer's recursion (a 100,000-deep ``[[[...]]]`` would be a ``RecursionError``).
    """
    import yaml

    class Bounded(yaml.SafeLoader):
        aliases = 0
        depth = 0

        def compose_node(self, parent: Any, index: Any) -> Any:
            if self.check_event(yaml.AliasEvent):
                self.aliases += 1
                if self.aliases > MAX_YAML_ALIASES:
                    raise UsageError(f"{where}: more than {MAX_YAML_ALIASES} YAML aliases (*name); refused")
            self.depth += 1
            if self.depth > MAX_YAML_DEPTH:
                raise UsageError(f"{where}: YAML nested more than {MAX_YAML_DEPTH} levels deep; refused")
            try:
                return super().compose_node(parent, index)
            finally:
                self.depth -= 1

    loader = Bounded(text)
    try:
        return loader.get_single_data()
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or type(exc).__name__
        raise UsageError(f"{where}: invalid YAML{at}: {str(problem)[:120]}") from None
    except RecursionError:
        raise UsageError(f"{where}: YAML nested too deeply; refused") from None
    finally:
        loader.dispose()


def find_profile(name_or_path: str | os.PathLike[str]) -> Path:
    """Return the profile file: an existing path as given, else ``NAME.yaml`` in ``profile_dirs()``."""
    text = os.fspath(name_or_path).strip()
    if not text:
        raise UsageError("profile name is empty")
    direct = Path(text).expanduser()
    if direct.is_file():
        return direct
    filename = text if text.endswith((".yaml", ".yml")) else f"{text}.yaml"
    searched: list[str] = []
    if "/" not in text and os.sep not in text:
        for d in profile_dirs():
            candidate = d / filename
            if candidate.is_file():
                return candidate
            searched.append(str(candidate))
    else:
        searched.append(str(direct))
    raise UsageError(f"profile {shown(text)} not found; looked in: {', '.join(searched)}")


def load_profile(name_or_path: str | os.PathLike[str]) -> dict[str, Any]:
    """Load and check a profile; return a flat dict of ``Settings`` field values plus any of the
    informational keys (description, expected_memory, requires_own_weights).

    The ``generation:`` mapping is flattened into max_new_tokens/temperature/top_p/seed so the
    result can be merged straight into ``Settings``. Values are coerced to the field types
    (``budget: 4096`` becomes "4096", policy option values become strings).
    """
    path = find_profile(name_or_path)
    where = f"profile {path}"
    raw = read_capped(path, MAX_PROFILE_BYTES, "profile")
    try:
        data = load_yaml(raw.decode("utf-8"), where)
    except UnicodeDecodeError as exc:
        raise UsageError(f"{where}: cannot read: not UTF-8 (invalid byte at offset {exc.start})") from None
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise UsageError(f"{where}: must be a mapping of keys to values, got {type(data).__name__}")

    out: dict[str, Any] = {}
    unknown = [k for k in data if k not in PROFILE_KEYS]  # all of them at once: one round trip to fix a file
    if unknown:
        named = ", ".join(shown(k) + (" (put it under generation:)" if k in GENERATION_KEYS else "")
                          for k in unknown[:8]) + (f" and {len(unknown) - 8:,} more" if len(unknown) > 8 else "")
        plural = "s" if len(unknown) > 1 else ""
        raise UsageError(f"{where}: unknown key{plural} {named}; "
                         f"valid keys: {', '.join(PROFILE_KEYS)}")
    for key, value in data.items():
        try:
            if key == "generation":
                if value is None:
                    continue
                if not isinstance(value, Mapping):
                    raise UsageError(f"generation must be a mapping with keys {', '.join(GENERATION_KEYS)}")
                bad = [f"generation.{str(k)[:80]}" for k in value if k not in GENERATION_KEYS]
                if bad:
                    raise UsageError(f"unknown key{'s' if len(bad) > 1 else ''} {', '.join(bad[:8])}; "
                                     f"valid keys: {', '.join(GENERATION_KEYS)}")
                for gkey, gvalue in value.items():
                    out[gkey] = _FIELD_CHECKS[gkey](f"generation.{gkey}", gvalue)
            elif key == "description":
                if value is not None and not isinstance(value, str):
                    raise UsageError(f"description must be text: got {shown(value)}")
                out[key] = value
            elif key == "expected_memory":
                if value is not None and not isinstance(value, Mapping):
                    raise UsageError(f"expected_memory must be a mapping: got {shown(value)}")
                out[key] = dict(value or {})
            elif key == "requires_own_weights":
                if not isinstance(value, bool):
                    raise UsageError(f"requires_own_weights must be true or false: got {shown(value)}")
                out[key] = value
            else:
                out[key] = _FIELD_CHECKS[key](key, value)
        except UsageError as exc:
            raise UsageError(f"{where}: {exc}") from None
    return out


def flag_name(key: str) -> str:
    """The command-line flag that sets setting ``key`` (``block_size`` → ``--block-size``)."""
    return "--policy-opt" if key == "policy_options" else "--" + key.replace("_", "-")


def resolve_settings(profile: str | os.PathLike[str] | None, overrides: Mapping[str, Any] | None = None) -> Settings:
    """Defaults, then the profile (if any), then CLI ``overrides``; the result is validated.

    An override of ``None`` means "not given on the command line" and is ignored. Unknown override
    keys are a UsageError (a CLI/setting-name mismatch should not pass silently).
    ``policy_options`` from the CLI are merged over the profile's, unless the CLI also selects a
    different policy, in which case the profile's options (meant for its own policy) are dropped.
    """
    values: dict[str, Any] = {}
    if profile is not None:
        values.update({k: v for k, v in load_profile(profile).items() if k in SETTINGS_FIELDS})

    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    unknown = [k for k in given if k not in SETTINGS_FIELDS]
    if unknown:
        raise UsageError(f"unknown setting{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
                         f"valid settings: {', '.join(SETTINGS_FIELDS)}")
    if "policy" in given and given["policy"] != values.get("policy", Settings.policy):
        # The profile's options were written for its own policy; they mean nothing to another one.
        values.pop("policy_options", None)
    for key, value in given.items():
        coerced = _FIELD_CHECKS[key](flag_name(key), value)  # a bad flag's error names the flag the user typed
        if key == "policy_options":
            coerced = {**values.get("policy_options", {}), **coerced}
        values[key] = coerced
    return Settings(**values).validate()
