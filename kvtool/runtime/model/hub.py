"""Models named by Hugging Face id (``ORG/NAME``, ``ORG/NAME@REVISION``), found in the local Hugging Face cache.

Every tool of the ecosystem (transformers, vLLM, ``hf download``) keeps models in one cache,
``models--ORG--NAME/`` under ``HF_HUB_CACHE``, else ``HF_HOME/hub``, else ``~/.cache/huggingface/hub``::

    refs/main                    the commit hash the branch ``main`` was at when downloaded
    snapshots/<commit>/NAME      links to ../../blobs/<etag> (the files of that commit)
    blobs/<etag>                 the contents (or a link into the cache-wide store blobs/xx/<hash>)
    blobs/<etag>.incomplete      a download in progress, or one that was interrupted

kvtool reads that cache through huggingface_hub's own ``snapshot_download(local_files_only=True)``
with huggingface_hub's offline switch on for the call, so nothing ever goes to the network,
whatever ``HF_HUB_OFFLINE`` says. Before that it reads the few small files the call reads whole
(refs, the cached tree listing) under caps, and afterwards it looks at what the snapshot holds, so
that a broken layout comes out as one line saying what is there and what is missing.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvtool.errors import UsageError, first_line
from kvtool.fileio import open_regular
from kvtool.runtime.memory import format_bytes

#: a revision after ``@``: a branch, a tag, a commit hash or ``refs/pr/N`` (no ``..``, no leading ``/``)
REVISION_RE = re.compile(r"^[A-Za-z0-9_.][A-Za-z0-9_./-]{0,254}$")
COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")
#: a ref file holds one commit hash; anything larger is not a ref
MAX_REF_BYTES = 1024
#: huggingface_hub's cached tree listing of one commit (a few hundred bytes per file of the repository)
MAX_TREE_BYTES = 64 << 20
#: a snapshot's index of sharded weights (one line per tensor: a few MiB for the largest models)
MAX_INDEX_BYTES = 64 << 20
#: directory entries looked at in one folder of the cache (a repository has tens of files)
MAX_ENTRIES = 10_000
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".pkl", ".gguf")
SAFETENSORS_INDEX = "model.safetensors.index.json"
#: the files of a checkpoint that must be in its snapshot when huggingface_hub's listing of the commit names them
#: (a repository's other files, such as ``original/*.pth`` or a second weights format, are often left out on purpose)
LISTED_NEEDED = ("config.json", "model.safetensors", SAFETENSORS_INDEX, "tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True)
class ModelId:
    """A Hugging Face model id and the revision asked for (None: ``main``)."""

    repo: str
    revision: str | None = None

    def __str__(self) -> str:
        return self.repo if self.revision is None else f"{self.repo}@{self.revision}"

    @property
    def folder(self) -> str:
        """The repository's folder in the cache, as huggingface_hub names it."""
        return "models--" + self.repo.replace("/", "--")

    def fetch_command(self) -> str:
        """The command that would put this model into the cache (kvtool itself never fetches)."""
        revision = f" --revision {self.revision}" if self.revision else ""
        return f"`hf download {self.repo}{revision}`"


@dataclass(frozen=True)
class CachedModel:
    """What an id resolved to: a checkpoint directory (``kind`` ``"dir"``) or one ``.gguf`` file (``"gguf"``)."""

    model_id: ModelId
    kind: str
    path: Path  # the snapshot folder, or the .gguf file in it (not resolved: its name is the file's own)
    commit: str


def parse_model_id(text: str) -> ModelId | None:
    """``ORG/NAME``, ``NAME`` or either with ``@REVISION`` as a :class:`ModelId`; None for anything else."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    repo, at, revision = text.strip().partition("@")
    if at and not REVISION_RE.match(revision) or ".." in revision:
        return None
    try:
        validate_repo_id(repo)
    except HFValidationError:
        return None
    return ModelId(repo, revision or None)


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache, resolved as huggingface_hub resolves it, from the environment of now.

    ``HF_HUB_CACHE`` (or the older ``HUGGINGFACE_HUB_CACHE``), else ``HF_HOME/hub``, else
    ``$XDG_CACHE_HOME/huggingface/hub``, else ``~/.cache/huggingface/hub``. huggingface_hub reads these once,
    when it is imported; kvtool reads them at each call and passes the folder on explicitly.
    """
    env = os.environ
    chosen = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE")
    if not chosen:
        home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"),
                                                  "huggingface")
        chosen = os.path.join(home, "hub")
    return Path(os.path.expandvars(os.path.expanduser(chosen)))


@contextlib.contextmanager
def offline() -> Iterator[None]:
    """huggingface_hub's offline switch on (every request it would make raises instead), restored after."""
    from huggingface_hub import constants

    was = constants.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE = was


def resolve_cached(model_id: ModelId, need_weights: bool = True) -> CachedModel:
    """The checkpoint ``model_id`` names in the local cache, or a one-line ``UsageError`` saying what is wrong.

    ``need_weights=False`` accepts a snapshot holding a config without weights (``kvtool profile`` plans
    from the config alone). A snapshot holding no config but exactly one ``.gguf`` file resolves to that file.
    """
    cache = hub_cache_dir()
    repo_dir = cache / model_id.folder
    if not repo_dir.is_dir():
        raise UsageError(f"{model_id} is not a local path, nor in the Hugging Face cache ({cache}); kvtool never "
                         f"downloads: fetch it with {model_id.fetch_command()} (or pass --model a local checkpoint "
                         "directory)")
    commit = _commit(model_id, repo_dir)
    snapshot = repo_dir / "snapshots" / commit
    if not snapshot.is_dir():
        there = _listing([name[:12] for name in entry_names(repo_dir / "snapshots")]) or "nothing"
        named = "" if COMMIT_RE.match(model_id.revision or "") else \
            f"{repo_dir / 'refs' / (model_id.revision or 'main')} names snapshot {commit[:12]}, but "
        raise UsageError(
            f"{model_id}: {named}{repo_dir / 'snapshots'} holds no snapshot {commit[:12]} (it holds {there}): the "
            f"download was interrupted or the snapshot deleted; fetch it again with {model_id.fetch_command()}")
    path = _hub_snapshot(model_id, cache, repo_dir, commit)
    return inspect_snapshot(model_id, repo_dir, path, commit, need_weights)



def _commit(model_id: ModelId, repo_dir: Path) -> str:
    """The commit the revision names: itself when it is a hash, else what its ref file holds."""
    revision = model_id.revision or "main"
    if COMMIT_RE.match(revision):
        return revision
    ref = repo_dir / "refs" / revision
    text = read_small(ref, MAX_REF_BYTES)
    if text is None:
        refs = ", ".join(f"{name} -> {commit[:7]}" for name, commit in cached_refs(repo_dir).items())
        raise UsageError(f"{model_id}: revision {revision!r} is not in the Hugging Face cache ({repo_dir}; cached: "
                         f"{refs or 'no refs'}): fetch it with {ModelId(model_id.repo, revision).fetch_command()}")
    commit = text.decode("utf-8", "replace").strip()
    if not COMMIT_RE.match(commit):
        raise UsageError(f"{model_id}: {ref} does not hold a commit hash (got {commit[:40]!r}): a damaged cache; "
                         f"fetch the model again with {model_id.fetch_command()}")
    return commit


def cached_refs(repo_dir: Path) -> dict[str, str]:
    """The repository's refs that hold a commit hash, by name (``main``, tags, ``refs/pr/N``), sorted."""
    out: dict[str, str] = {}
    root = repo_dir / "refs"
    for path in walk_files(root, depth=3):
        with contextlib.suppress(UsageError):
            text = read_small(path, MAX_REF_BYTES)
            commit = (text or b"").decode("utf-8", "replace").strip()
            if COMMIT_RE.match(commit):
                out[path.relative_to(root).as_posix()] = commit
    return dict(sorted(out.items()))


def _hub_snapshot(model_id: ModelId, cache: Path, repo_dir: Path, commit: str) -> Path:
    """huggingface_hub's own answer for the snapshot folder, asked offline (its tree listing read under a cap).

    Asked for ``config.json`` only: huggingface_hub 2.x refuses a snapshot missing any file its listing of the
    commit names, and people leave files out on purpose (``--exclude "original/*"``, one GGUF of many);
    :func:`inspect_snapshot` decides what a checkpoint needs.
    """
    import huggingface_hub
    from huggingface_hub import errors

    read_small(repo_dir / "trees" / f"{commit}.json", MAX_TREE_BYTES)  # what the call reads whole, checked first
    try:
        with offline():
            found = huggingface_hub.snapshot_download(model_id.repo, revision=model_id.revision, cache_dir=str(cache),
                                                      local_files_only=True, allow_patterns=["config.json"])
    except errors.LocalEntryNotFoundError as exc:
        incomplete = getattr(errors, "IncompleteSnapshotError", None)  # huggingface_hub 2.x checks its tree listing
        if incomplete is None or not isinstance(exc, incomplete):
            raise UsageError(f"{model_id}: huggingface_hub finds no snapshot in {repo_dir} ({first_line(exc, 160)}): "
                             f"fetch it with {model_id.fetch_command()}") from None
        missing = re.search(r"(\d+ file\(s\) are missing \([^)]*\))", str(exc))
        raise UsageError(f"{model_id} is only partly downloaded ({repo_dir / 'snapshots' / commit[:12]}: "
                         f"{missing.group(1) if missing else first_line(exc, 160)}): finish it with "
                         f"{model_id.fetch_command()}") from None
    except (OSError, ValueError) as exc:
        raise UsageError(f"{model_id}: huggingface_hub finds no snapshot in {repo_dir} ({first_line(exc, 160)}): "
                         f"fetch it with {model_id.fetch_command()}") from None
    return Path(found)


def inspect_snapshot(model_id: ModelId, repo_dir: Path, snapshot: Path, commit: str,
                     need_weights: bool) -> CachedModel:
    """What the snapshot holds decides: a checkpoint directory, its one GGUF file, or one line saying what is
    missing."""
    present, dangling = snapshot_entries(snapshot)
    where = f"{model_id} ({snapshot})"
    if dangling:
        raise UsageError(f"{where} is only partly downloaded: {_listing(dangling)} point(s) at blobs that are not "
                         f"there{_incomplete_note(repo_dir)}; finish it with {model_id.fetch_command()}")
    ggufs = sorted(name for name in present if name.lower().endswith(".gguf"))
    if "config.json" not in present:
        if len(ggufs) == 1:
            return CachedModel(model_id, "gguf", snapshot / ggufs[0], commit)
        if ggufs:
            raise UsageError(f"{model_id} holds only GGUF files ({_listing(ggufs, 6)}): pick one with "
                             f"--model {snapshot / ggufs[0]}")
        raise UsageError(f"{where} holds no config.json and no .gguf file (it holds {_listing(present) or 'nothing'})"
                         f"{_incomplete_note(repo_dir)}: not a checkpoint kvtool can load")
    missing = sorted(set(missing_shards(snapshot, present)) | set(listed_missing(repo_dir, commit, present)))
    if missing:
        raise UsageError(f"{where} is only partly downloaded: it has {_listing(_config_first(present))} but not "
                         f"{_listing(missing)}{_incomplete_note(repo_dir)}; finish it with {model_id.fetch_command()}")
    if need_weights and not any(name.endswith(WEIGHT_SUFFIXES) for name in present):
        raise UsageError(f"{where} has {_listing(_config_first(present))} but no weights (*.safetensors)"
                         f"{_incomplete_note(repo_dir)}: fetch them with {model_id.fetch_command()}")
    return CachedModel(model_id, "dir", snapshot, commit)


def snapshot_entries(snapshot: Path) -> tuple[set[str], list[str]]:
    """The names of the snapshot's top-level files whose content is there, and those whose link leads nowhere."""
    present: set[str] = set()
    dangling: list[str] = []
    for name in entry_names(snapshot):
        path = snapshot / name
        try:
            if stat.S_ISREG(path.stat().st_mode):
                present.add(name)
        except FileNotFoundError:
            if path.is_symlink():
                dangling.append(name)
        except OSError:
            dangling.append(name)
    return present, sorted(dangling)


def missing_shards(snapshot: Path, present: set[str]) -> list[str]:
    """The weight files the snapshot's index names that are not in the snapshot (sorted)."""
    if SAFETENSORS_INDEX not in present:
        return []
    from kvtool.kvc.format import loads

    try:
        index = loads(read_small(snapshot / SAFETENSORS_INDEX, MAX_INDEX_BYTES) or b"{}", MAX_ENTRIES)
        files = set(index["weight_map"].values())
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as exc:
        raise UsageError(f"{snapshot / SAFETENSORS_INDEX} is not a valid index of weight files: "
                         f"{first_line(exc, 120)}") from None
    return sorted(str(name) for name in files if name not in present)


def listed_missing(repo_dir: Path, commit: str, present: set[str]) -> list[str]:
    """The files of :data:`LISTED_NEEDED` that huggingface_hub's cached listing of the commit names (the files it
    would download) but the snapshot lacks: a download cut short before their links were made."""
    from kvtool.kvc.format import loads

    raw = read_small(repo_dir / "trees" / f"{commit}.json", MAX_TREE_BYTES)
    if raw is None:
        return []
    try:
        listed = loads(raw, 1 << 20)["files"]
        names = {name for name in LISTED_NEEDED if name in listed}
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return []  # huggingface_hub ignores a listing it cannot read, and so does kvtool
    return sorted(names - present)


def incomplete_blobs(repo_dir: Path) -> tuple[int, int]:
    """How many interrupted downloads (``blobs/*.incomplete``) the repository holds, and their bytes so far."""
    count = size = 0
    for name in entry_names(repo_dir / "blobs"):
        if name.endswith(".incomplete"):
            count += 1
            with contextlib.suppress(OSError):
                size += (repo_dir / "blobs" / name).lstat().st_size
    return count, size


def _incomplete_note(repo_dir: Path) -> str:
    count, size = incomplete_blobs(repo_dir)
    if not count:
        return ""
    return f" (blobs/ holds {count} interrupted download(s), *.incomplete, {format_bytes(size)} so far)"


def read_small(path: Path, cap: int, root: Path | None = None) -> bytes | None:
    """A small file of the cache read whole (None when absent), its links followed only inside ``root``.

    The file, once its links are resolved, must be a regular file of at most ``cap`` bytes; it is opened
    without following a link and without waiting on a FIFO. With ``root`` (a snapshot's files link into the
    repository's ``blobs/`` and from there into the cache-wide store), a link leading outside it is refused.
    """
    try:
        real = path.resolve(strict=True)
    except FileNotFoundError:
        return None
    except (OSError, RuntimeError) as exc:  # a link loop
        raise UsageError(f"cannot read {path}: {first_line(exc, 120)}") from None
    if root is not None and not real.is_relative_to(root.resolve()):
        raise UsageError(f"{path} links to {real}, outside the Hugging Face cache ({root}); refused unread")
    try:
        fd = open_regular(real)
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror or first_line(exc, 120)}") from None
    try:
        with os.fdopen(fd, "rb", closefd=False) as fh:
            data = fh.read(cap + 1)
    finally:
        os.close(fd)
    if len(data) > cap:
        raise UsageError(f"{path} is larger than {format_bytes(cap)}, more than such a file ever needs; refused unread")
    return data


def entry_names(directory: Path) -> list[str]:
    """The entry names of a cache folder (sorted; none when it is missing), at most ``MAX_ENTRIES`` of them."""
    names: list[str] = []
    try:
        with os.scandir(directory) as entries:
            for entry in entries:
                if len(names) >= MAX_ENTRIES:
                    raise UsageError(f"{directory} holds more than {MAX_ENTRIES:,} entries: not a Hugging Face "
                                     "cache folder; refused")
                if not entry.name.startswith("."):
                    names.append(entry.name)
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as exc:
        raise UsageError(f"cannot list {directory}: {exc.strerror or first_line(exc, 120)}") from None
    return sorted(names)


def walk_files(root: Path, depth: int, links: bool = False) -> Iterator[Path]:
    """Regular files under ``root`` (and links, with ``links``), at most ``depth`` folders deep; linked
    folders are not entered."""
    for name in entry_names(root):
        path = root / name
        try:
            mode = path.lstat().st_mode
        except OSError:
            continue
        if stat.S_ISREG(mode) or (links and stat.S_ISLNK(mode)):
            yield path
        elif stat.S_ISDIR(mode) and depth > 1:
            yield from walk_files(path, depth - 1, links)


def _config_first(names: set[str]) -> list[str]:
    """A checkpoint's file names, the config and the weights first (what says what the snapshot is)."""
    return sorted(names, key=lambda name: (name != "config.json", not name.endswith(WEIGHT_SUFFIXES), name))


def _listing(names: list[str] | set[str], most: int = 3) -> str:
    """``a, b, c (+4 more)``: a few names (sets sorted, lists in their order), and how many were left out."""
    names = sorted(names) if isinstance(names, set) else names
    shown = ", ".join(names[:most])
    return shown + (f" (+{len(names) - most} more)" if len(names) > most else "")
