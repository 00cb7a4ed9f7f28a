"""Settings, budgets and profiles: every mistake a user can make is a one-line UsageError naming it."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtool.core.costs import CacheCosts
from kvtool.errors import EXIT_USAGE, UsageError
from kvtool.runtime.budget import Budget, parse_budget, parse_size
from kvtool.runtime.settings import PROFILE_KEYS, Settings, find_profile, load_profile, resolve_settings

REPO_PROFILES = Path(__file__).resolve().parent.parent / "kvtool" / "profiles"


# -- budgets ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "tokens"),
    [
        ("4096", 4096),
        (4096, 4096),
        ("4k", 4096),
        ("4K", 4096),
        ("1.5k", 1536),
        ("1m", 1024**2),
        (" 16 ", 16),
        ("1", 1),
    ],
)
def test_parse_budget_tokens(text: str | int, tokens: int) -> None:
    b = parse_budget(text)
    assert b == Budget(tokens=tokens, nbytes=None, text=str(text).strip())


@pytest.mark.parametrize(
    ("text", "nbytes"),
    [
        ("512MiB", 512 * 2**20),
        ("2GB", 2 * 10**9),
        ("1.5GiB", 3 * 2**29),
        ("800MB", 800 * 10**6),
        ("123B", 123),
        ("4kb", 4000),
        ("4KiB", 4096),
        ("1tib", 2**40),
        ("1TB", 10**12),
        ("2 gib", 2 * 2**30),
    ],
)
def test_parse_budget_bytes(text: str, nbytes: int) -> None:
    b = parse_budget(text)
    assert b.tokens is None and b.nbytes == nbytes and b.text == text


@pytest.mark.parametrize(
    "text", ["", "x", "4q", "-5", "0", "0k", "1e3", "k", "4 k b", "nan", "1.2.3k", True, 3.5, None]
)
def test_parse_budget_rejects(text: object) -> None:
    with pytest.raises(UsageError) as err:
        parse_budget(text)  # type: ignore[arg-type]
    msg = str(err.value)
    assert "\n" not in msg and "budget" in msg
    assert err.value.exit_code == EXIT_USAGE


def test_parse_budget_message_names_the_input() -> None:
    with pytest.raises(UsageError, match=r"token count like 4096 or 4k, or a size like 512MiB: got 'lots'"):
        parse_budget("lots")


def test_parse_size() -> None:
    assert parse_size("8GiB") == 8 * 2**30
    assert parse_size("2GB") == 2 * 10**9
    assert parse_size("123B") == 123
    assert parse_size("1024") == 1024
    assert parse_size(77) == 77
    for bad in ("4k", "lots", "0B", "", "-1GB"):
        with pytest.raises(UsageError):
            parse_size(bad)


def test_budget_tokens_from_bytes_by_hand() -> None:
    # 2 (K,V) * 4 layers * 2 KV heads * 8 dims * 2 bytes = 256 bytes per token
    small = CacheCosts(layers=4, kv_heads=2, head_dim=8, compute_bytes=2)
    assert small.kv_token == 256
    assert small.budget_tokens(256 * 100) == 100
    assert small.budget_tokens(256 * 100 + 255) == 100  # rounded down
    assert small.budget_tokens(256) == 1
    # Llama-3.1-8B bf16: 128 KiB per token, so 512 MiB = 4096 tokens per head
    assert CacheCosts(layers=32, kv_heads=8, head_dim=128, compute_bytes=2).budget_tokens(512 * 2**20) == 4096
    with pytest.raises(UsageError, match="holds no token"):
        small.budget_tokens(255)


# -- Settings.validate ----------------------------------------------------------------------------


def test_defaults_validate() -> None:
    s = Settings().validate()
    assert s.model is None and s.policy == "h2o" and s.budget == "1k"
    assert s.parsed_budget.tokens == 1024
    assert s.policy_options == {} and Settings().policy_options is not s.policy_options


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("block_size", 0),
        ("block_size", "big"),
        ("sinks", -1),
        ("recent", -1),
        ("recent", 1.5),
        ("quantize", "2bit"),
        ("dtype", "float64"),
        ("device", "gpu"),
        ("positions", "relative"),
        ("temperature", -0.1),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("max_new_tokens", 0),
        ("budget", "lots"),
        ("budget", "0"),
        ("seed", "x"),
        ("policy", ""),
        ("policy_options", ["a"]),
        ("model", ""),
    ],
)
def test_validate_names_the_field(field: str, value: object) -> None:
    s = Settings(**{field: value})
    with pytest.raises(UsageError) as err:
        s.validate()
    assert str(err.value).startswith(field) and "\n" not in str(err.value)


def test_validate_normalises_harmless_types() -> None:
    s = Settings(budget=4096, temperature=1, top_p=1, device="cuda:1").validate()  # type: ignore[arg-type]
    assert s.budget == "4096" and isinstance(s.temperature, float) and s.top_p == 1.0


# -- profiles ------------------------------------------------------------------------------------


def write(tmp_path: Path, text: str, name: str = "p.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_load_profile_flattens_generation(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "policy: h2o\npolicy_options: {ratio: 0.5, fast: true}\nbudget: 2048\n"
        "generation: {temperature: 0.7, seed: 3}\ndescription: hi\nrequires_own_weights: false\n"
        "expected_memory: {predicted_peak_bytes: 1}\n",
    )
    p = load_profile(path)
    assert p["policy"] == "h2o"
    assert p["policy_options"] == {"ratio": "0.5", "fast": "true"}
    assert p["budget"] == "2048"
    assert p["temperature"] == 0.7 and p["seed"] == 3
    assert p["description"] == "hi" and p["expected_memory"] == {"predicted_peak_bytes": 1}


def test_unknown_key_is_named_with_valid_keys(tmp_path: Path) -> None:
    path = write(tmp_path, "polcy: h2o\n")
    with pytest.raises(UsageError) as err:
        load_profile(path)
    msg = str(err.value)
    assert "'polcy'" in msg and "valid keys" in msg and "block_size" in msg and "\n" not in msg


def test_generation_key_at_top_level_gets_a_hint(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=r"'temperature' \(put it under generation:\)"):
        load_profile(write(tmp_path, "temperature: 0.5\n"))
    with pytest.raises(UsageError, match="generation.temp"):
        load_profile(write(tmp_path, "generation: {temp: 0.5}\n"))


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("block_size: 0\n", "block_size"),
        ("block_size: many\n", "block_size"),
        ("budget: lots\n", "budget"),
        ("quantize: 3bit\n", "quantize"),
        ("generation: {top_p: 2}\n", "generation.top_p"),
        ("generation: 5\n", "generation"),
        ("policy_options: [a, b]\n", "policy_options"),
        ("requires_own_weights: maybe\n", "requires_own_weights"),
        ("expected_memory: 5\n", "expected_memory"),
        ("sinks: true\n", "sinks"),
    ],
)
def test_bad_values_name_the_key(tmp_path: Path, text: str, key: str) -> None:
    with pytest.raises(UsageError) as err:
        load_profile(write(tmp_path, text))
    msg = str(err.value)
    assert f": {key}" in msg and "\n" not in msg


def test_yaml_syntax_error_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(UsageError) as err:
        load_profile(write(tmp_path, "budget: [1k\nsinks: 4\n"))
    msg = str(err.value)
    assert "invalid YAML" in msg and "line" in msg and "\n" not in msg


def test_non_mapping_and_empty_profiles(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="mapping"):
        load_profile(write(tmp_path, "- a\n- b\n"))
    assert load_profile(write(tmp_path, "", "empty.yaml")) == {}


def test_find_profile_search_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "home"
    (home / "profiles").mkdir(parents=True)
    write(home / "profiles", "budget: 2k\n", "mine.yaml")
    monkeypatch.setenv("KVTOOL_HOME", str(home))
    monkeypatch.chdir(tmp_path)
    assert find_profile("mine") == home / "profiles" / "mine.yaml"
    # ./profiles wins over $KVTOOL_HOME
    (tmp_path / "profiles").mkdir()
    local = write(tmp_path / "profiles", "budget: 3k\n", "mine.yaml")
    assert find_profile("mine") == Path.cwd() / "profiles" / "mine.yaml"
    assert find_profile("mine.yaml").resolve() == local.resolve()
    # the repository's profiles are found from anywhere
    assert find_profile("gpu-8b-4bit").resolve() == (REPO_PROFILES / "gpu-8b-4bit.yaml").resolve()
    # an explicit path
    other = write(tmp_path, "budget: 5k\n", "elsewhere.yml")
    assert find_profile(str(other)) == other


def test_find_profile_not_found_lists_places(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTOOL_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError) as err:
        find_profile("nope")
    msg = str(err.value)
    assert "'nope' not found" in msg and str(tmp_path / "home" / "profiles" / "nope.yaml") in msg
    assert str(REPO_PROFILES / "nope.yaml") in msg and "\n" not in msg


# -- resolve_settings ------------------------------------------------------------------------------


def test_resolve_precedence(tmp_path: Path) -> None:
    path = write(tmp_path, "budget: 2k\nsinks: 2\npolicy: h2o\npolicy_options: {a: 1, b: 2}\ngeneration: {seed: 7}\n")
    s = resolve_settings(str(path), {"sinks": 6, "recent": None, "budget": None, "policy_options": {"b": "3"}})
    assert s.budget == "2k"  # None = not given on the CLI
    assert s.sinks == 6 and s.recent == 8 and s.seed == 7
    assert s.policy_options == {"a": "1", "b": "3"}  # CLI options merge over the profile's


def test_resolve_other_policy_drops_profile_options(tmp_path: Path) -> None:
    path = write(tmp_path, "policy: h2o\npolicy_options: {a: 1}\n")
    assert resolve_settings(str(path), {"policy": "keydiff"}).policy_options == {}
    assert resolve_settings(str(path), {"policy": "h2o"}).policy_options == {"a": "1"}


def test_resolve_without_profile_and_bad_overrides() -> None:
    assert resolve_settings(None, {}) == Settings()
    assert resolve_settings(None, {"budget": 512}).budget == "512"
    with pytest.raises(UsageError, match="^--block-size"):  # overrides are flags: the error names the flag
        resolve_settings(None, {"block_size": 0})
    with pytest.raises(UsageError, match="^--policy-opt"):
        resolve_settings(None, {"policy_options": "x"})
    with pytest.raises(UsageError, match="unknown setting 'blocks'"):
        resolve_settings(None, {"blocks": 3})


@pytest.mark.parametrize("path", sorted(REPO_PROFILES.glob("*.yaml")), ids=lambda p: p.stem)
def test_shipped_profiles_load_and_validate(path: Path) -> None:
    data = load_profile(path)
    assert set(data) <= set(PROFILE_KEYS) | {"max_new_tokens", "temperature", "top_p", "seed"}
    assert isinstance(data.get("description"), str) and data["description"]
    s = resolve_settings(path.stem, {})
    assert s.parsed_budget.tokens is not None
    if data.get("requires_own_weights"):
        assert s.model and "download" in data["description"]


def test_shipped_profiles_exist() -> None:
    assert {p.stem for p in REPO_PROFILES.glob("*.yaml")} >= {"default", "gpu-8b-4bit", "gpu-3b-bf16"}
    d = resolve_settings("default", {})
    assert d == Settings()
