"""State that ends with its document: after any document — answered, failed at any point, recalling with a long
answer, or a ``.kvc`` — the next one gets exactly the answer, evictions and memory of a fresh process.

Two levels: the engine's (``Engine.reuse_cache`` after a failed block or a recalled answer gives a cache whose
every field, buffer size and logit is a new cache's), and the many-document worker's (a sequence of such
documents, each followed by the same document B, every B's record and held bytes equal to B's alone).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvtool.runtime.many import DocumentWorker, Job, Task
from kvtool.runtime.settings import resolve_settings
from tests.faults import WORKSPACE, Fault, endless_answers, held_bytes
from tests.helpers import VOCAB, make_engine, stream_logits, tiny_checkpoint, tiny_llama

QUESTION = "Who sat on the mat?"


def signature(root: Any) -> Any:
    """Every field of ``root`` and of the kvtool objects it holds, as comparable values: numbers, flags and
    strings as they are, a tensor as its shape and dtype (the contents of unused slots may differ), an object
    of another library as its type, a table keyed by objects' ids as its values; work buffers (``WORKSPACE``)
    left out. Two caches with the same signature are in the same state but for the tokens stored beyond
    their length and the size of their work buffers."""
    seen: set[int] = set()

    def walk(obj: Any) -> Any:
        if obj is None or isinstance(obj, (bool, int, float, str, torch.dtype, torch.device)):
            return obj
        if isinstance(obj, torch.Tensor):
            return ("tensor", tuple(obj.shape), obj.dtype)
        if id(obj) in seen:
            return ("seen", type(obj).__name__)
        seen.add(id(obj))
        if isinstance(obj, dict):  # a table keyed by objects' ids: its values, in the order they were made
            if obj and all(isinstance(k, int) and k > 1 << 24 for k in obj):
                return [walk(v) for v in obj.values()]
            return {str(k): walk(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return [walk(v) for v in obj]
        if type(obj).__module__.startswith("kvtool.") and hasattr(obj, "__dict__") and not callable(obj):
            return (type(obj).__name__, {k: walk(v) for k, v in sorted(vars(obj).items()) if k not in WORKSPACE})
        return type(obj).__name__

    return walk(root)


def decode(engine, cache, question: torch.Tensor, tokens: int, snap: Any = None) -> list[int]:
    """Ask ``question`` after the document the cache holds (``snap``: its snapshot; with recall when it is on)
    and decode ``tokens`` tokens (no end token), as a session does."""
    snap = snap or cache.snapshot()
    logits, _ = engine.feed_question(cache, question, lambda: cache.restore(snap), tokens)
    ids, _ = engine.generate(cache, logits, tokens, set())
    cache.pin_start = cache.pin_end = None
    return ids


# --------------------------------------------------------------------------------------------- the engine
@pytest.mark.parametrize("policy, positions, kv_dtype, layer", [
    ("h2o", "absolute", None, 2), ("tova", "compact", "int4", 1), ("snapkv", "auto", "int8", 2),
    ("keydiff", "absolute", None, 1),
])
def test_a_cache_reused_after_a_failed_block_or_a_recall_is_a_new_cache(policy, positions, kv_dtype, layer):
    """A block that fails in layer ``layer`` (the layers before it appended and deferred their eviction), and a
    recalled answer decoded past a block: ``reuse_cache`` leaves every field and buffer as a new cache's,
    and the next document's logits, evictions and answer are a new cache's."""
    kw = {"kv_dtype": kv_dtype} if kv_dtype else {}
    model = tiny_llama(num_hidden_layers=3, max_positions=256)
    engine = make_engine(model, policy, 48, block_size=16, positions=positions, recall=24, **kw)
    g = torch.Generator().manual_seed(3)
    first, second = torch.randint(0, VOCAB, (300,), generator=g), torch.randint(0, VOCAB, (60,), generator=g)
    question = torch.randint(0, VOCAB, (6,), generator=g)
    fresh = engine.new_cache()
    blank = signature(fresh)
    room = [g.usable_slots for g in fresh.groups()]
    expected, _ = stream_logits(engine, second, fresh)
    expected_ids = decode(engine, fresh, question, 40)
    expected_held = held_bytes(fresh)
    assert 0 < fresh.groups()[0].recalled.shape[1] < 24  # recalled all it archived: less than the first document

    cache = engine.new_cache()
    with Fault(model, "read", nth=8, layer=layer) as fault:
        fault.arm()
        with pytest.raises(torch.OutOfMemoryError):
            stream_logits(engine, first, cache)
    assert fault.fired == 1 and any(st.pending for st in cache.stacks) == (layer > 0 and bool(cache.stacks))
    engine.reuse_cache(cache)
    after_failure = signature(cache)
    got, _ = stream_logits(engine, second, cache)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert after_failure == blank

    engine.reuse_cache(cache)
    stream_logits(engine, first, cache)
    snap = cache.snapshot()
    decode(engine, cache, question, 60, snap)  # recalls 24 tokens per head (the second document recalls fewer)
    assert max(g.usable_slots for g in cache.groups()) > 48 + 16 + 12
    engine.reuse_cache(cache)
    after_recall = signature(cache)
    got, _ = stream_logits(engine, second, cache)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert decode(engine, cache, question, 40) == expected_ids
    assert cache.counters.evicted_tokens == fresh.counters.evicted_tokens
    assert held_bytes(cache) == expected_held
    assert after_recall == blank

    engine.reuse_cache(cache)
    stream_logits(engine, first, cache)
    snap = cache.snapshot()
    decode(engine, cache, question, 60, snap)
    cache.restore(snap)  # the room recall took goes back with the answer's tokens (the next question's own)
    assert [g.usable_slots for g in cache.groups()] == room

    workspace = held_bytes(cache, frozenset()) - held_bytes(cache)  # the work buffers kept across documents
    assert workspace > 0
    for _ in range(2):  # kept at the largest a document needed: the same documents again grow them no more
        engine.reuse_cache(cache)
        stream_logits(engine, first, cache)
        decode(engine, cache, question, 60)
        assert held_bytes(cache, frozenset()) - held_bytes(cache) == workspace


# --------------------------------------------------------------------------------------------- the worker
def comparable(record: dict[str, Any]) -> dict[str, Any]:
    """A record without what depends on the clock or the process (timings, RSS, load time)."""
    stats = {k: v for k, v in record.get("stats", {}).items()
             if not any(w in k for w in ("seconds", "per_second", "peak_memory", "threads_min", "time_split"))}
    return {**record, "stats": stats}


def write_doc(path: Path, sentences: int, start: int = 0) -> str:
    path.write_text(" ".join(f"The cat number {start + j} sat on mat {j}; the door was {('red', 'blue')[j % 2]}."
                             for j in range(sentences)), encoding="utf-8")
    return str(path)


def job(path: str) -> Job:
    return Job(path=path, location=path, keys=[QUESTION])


class Sequence:
    """One many-document worker reading documents in turn, with a fault injector and endless answers."""

    def __init__(self, settings) -> None:
        self.worker = DocumentWorker(Task("ask", settings, [QUESTION]))
        self.worker.start()
        self.session = self.worker.session
        self.fault = Fault(self.session.model).__enter__()
        self.endless = endless_answers(self.session.model, self.session.eos)

    def run(self, path: str, fault: tuple[str, int] | None = None) -> list[dict[str, Any]]:
        if fault is not None:
            self.fault.arm(*fault)
        out = list(self.worker.run(job(path)))
        assert not self.fault.armed, f"the fault {fault} was never reached"
        return out

    def held(self) -> int:
        return held_bytes(self.session.last_read.cache)

    def close(self) -> None:
        self.fault.__exit__()
        self.endless.remove()


def sequence_check(settings, docs: dict[str, str], kvc: str) -> None:
    """Document B after each kind of document (failed in its read, its question or its decode; recalled
    with a long answer; a .kvc) gives B's record, cache bytes and held bytes alone; one cache throughout."""
    alone = Sequence(settings)
    try:
        expected = [comparable(r) for r in alone.run(docs["B"])]
        expected_held = alone.held()
        assert expected[0]["stats"]["recalled_tokens_max"] > 0 and "error" not in expected[0]
    finally:
        alone.close()
    kvc_alone = Sequence(settings)  # the .kvc as a fresh process reads it: what a session holds after it
    try:
        assert "error" not in kvc_alone.run(kvc)[0]
        kvc_held = held_bytes(kvc_alone.session)
    finally:
        kvc_alone.close()

    s = Sequence(settings)
    try:
        before = [("read", docs["F"], ("read", 9)), ("question", docs["F"], ("question", 2)),
                  ("decode", docs["F"], ("decode", 30)), ("recalling", docs["R"], None), ("kvc", kvc, None)]
        for what, path, fault in before:
            first = s.run(path, fault)
            assert ("error" in first[0]) == (fault is not None), first
            if fault is not None:  # the injected failure is the document's record, and the run goes on
                assert "injected in layer 1" in first[0]["error"] and first[0]["exit_code"] == 1, first
            if what == "recalling":
                assert first[0]["stats"]["recalled_tokens_max"] > expected[0]["stats"]["recalled_tokens_max"]
            if what == "kvc":  # memory is one cache: the text documents' and the .kvc's are the same one
                assert len(s.fault.caches) == 1 and held_bytes(s.session) == kvc_held
            got = [comparable(r) for r in s.run(docs["B"])]
            assert got == expected, f"B after a {what} document differs from B alone"
            assert s.held() == expected_held, f"B after a {what} document holds other bytes than B alone"
        assert s.fault.fired == 3 and len(s.fault.caches) == 1
    finally:
        s.close()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tiny_checkpoint(tmp_path_factory.mktemp("state") / "tiny", layers=3))


def test_after_any_document_the_next_is_read_as_by_a_fresh_process(model_dir, tmp_path):
    settings = resolve_settings(None, dict(model=model_dir, budget="160", block_size=32, max_new_tokens=48,
                                           threads=1, recall="64"))
    docs = {"F": write_doc(tmp_path / "f.txt", 40, 100), "R": write_doc(tmp_path / "r.txt", 60, 300),
            "B": write_doc(tmp_path / "b.txt", 4, 900)}  # B archives fewer tokens than R recalls
    kvc = str(tmp_path / "k.kvc")
    prefill = DocumentWorker(Task("prefill", settings))
    records = list(prefill.run(Job(path=docs["R"], location=docs["R"], keys=["prefill"], output=kvc)))
    assert "error" not in records[0], records
    sequence_check(settings, docs, kvc)


def test_a_disk_that_ran_short_turns_recall_off_for_its_document_only(model_dir, tmp_path, monkeypatch):
    """``--recall auto``: a document whose archive disk ran short while it was read answers without recall; the
    .kvc after it recalls from its archive as it does alone (recall on, no note left from the document before)."""
    from kvtool.runtime import archive_disk

    monkeypatch.setenv("KVTOOL_ARCHIVE_DIR", str(tmp_path))
    monkeypatch.setattr(archive_disk, "disk", lambda d: archive_disk.Disk(free=1 << 40, total=1 << 41))
    settings = resolve_settings(None, dict(model=model_dir, budget="160", block_size=32, max_new_tokens=8,
                                           threads=1))  # --recall auto, the default
    short, long = write_doc(tmp_path / "s.txt", 20, 50), write_doc(tmp_path / "r.txt", 40, 300)
    kvc = str(tmp_path / "r.kvc")
    prefill = DocumentWorker(Task("prefill", settings))
    assert "error" not in list(prefill.run(Job(path=long, location=long, keys=["prefill"], output=kvc)))[0]
    alone = Sequence(settings)
    try:
        expected = [comparable(r) for r in alone.run(kvc)]
    finally:
        alone.close()
    assert expected[0]["stats"]["recall_tokens"] > 0 and expected[0]["stats"]["recalled_tokens_max"] > 0
    s = Sequence(settings)
    try:
        with monkeypatch.context() as m:  # the length unknown (stdin): watched, and the disk runs short
            m.setattr(archive_disk, "WATCH_STEP", 1)
            m.setattr(archive_disk, "disk", lambda d: archive_disk.Disk(free=1 << 20, total=1 << 34))
            m.setattr("kvtool.runtime.session.estimate_tokens", lambda doc: None)
            first = s.run(short)[0]
        assert first["stats"]["recall_tokens"] == 0 and first["stats"]["recall_note"].startswith("recall off")
        assert [comparable(r) for r in s.run(kvc)] == expected
    finally:
        s.close()


CORPUS = Path(__file__).resolve().parents[2] / "shared" / "corpus" / "paul_graham_essays"


@pytest.mark.real_model
def test_after_any_document_the_next_is_read_as_by_a_fresh_process_real_model(tmp_path, monkeypatch):
    """The same sequence on the embedded model: B (about 350 tokens, recalling what its read archived) after a
    document failing in its read, its question and its decode, after an 800-token document recalling 128
    tokens per head with a 40-token answer, and after a .kvc, each time as B alone."""
    from kvtool.runtime.model import load_model

    loaded = load_model(None)  # each worker is a fresh session; the weights are loaded once for the test
    monkeypatch.setattr("kvtool.runtime.session.load_model", lambda *args, **kwargs: loaded)
    settings = resolve_settings(None, dict(budget="256", block_size=32, max_new_tokens=40, threads=1,
                                           recall="128"))

    def essay(name: str, chars: int) -> str:
        path = tmp_path / name
        path.write_text((CORPUS / name).read_text(encoding="utf-8")[:chars], encoding="utf-8")
        return str(path)

    docs = {"F": essay("avg.txt", 2100), "R": essay("apple.txt", 3400), "B": essay("aord.txt", 1500)}
    kvc = str(tmp_path / "k.kvc")
    prefill = DocumentWorker(Task("prefill", settings))
    records = list(prefill.run(Job(path=docs["R"], location=docs["R"], keys=["prefill"], output=kvc)))
    assert "error" not in records[0], records
    sequence_check(settings, docs, kvc)
