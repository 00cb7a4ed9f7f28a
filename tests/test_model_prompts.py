"""A model's own stop rules (``generation_config.json``) and base models (no chat template: a plain prompt)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from kvtool.cli.app import main
from kvtool.errors import UsageError
from kvtool.runtime import prompt
from kvtool.runtime.tokens import encode_text
from tests.helpers import strip_chat_template, tiny_checkpoint, tiny_tokenizer

TEXT = "The cache is small and the pass key is 12345. Hello world, the cache is small."


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("chat") / "tiny-chat")


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return strip_chat_template(tiny_checkpoint(tmp_path_factory.mktemp("base") / "tiny-base"))


def _session(model_dir: Path, notes: list[str] | None = None, **settings):
    from kvtool.runtime.session import Session
    from kvtool.runtime.settings import resolve_settings

    values = {
        "model": str(model_dir),
        "policy": "full",
        "budget": "4k",
        "block_size": 32,
        "recall": "off",
        "max_new_tokens": 8,
        "no_repeat_ngram": 0,
        "device": "cpu",
        **settings,
    }
    return Session(resolve_settings(None, values), say=(notes.append if notes is not None else None))


def _ask(session, doc: Path, question: str = "What is the pass key?"):
    from kvtool.documents import open_document

    return session.ask(session.read(open_document(str(doc))), question)


# -- stop rules ---------------------------------------------------------------------------------------------------


def test_stop_ids_come_from_the_tokenizer_the_config_and_generation_config() -> None:
    from types import SimpleNamespace

    tok = tiny_tokenizer()
    end = tok.convert_tokens_to_ids("<|im_end|>")
    ids = prompt.eos_ids(tok, SimpleNamespace(eos_token_id=7), SimpleNamespace(eos_token_id=[11, 12, True, -1, "x"]))
    assert ids == {end, 7, 11, 12}
    assert prompt.eos_ids(tok, None, SimpleNamespace(eos_token_id=13)) == {end, 13}
    with pytest.raises(UsageError, match="generation_config.json lists 65 end-of-answer token ids"):
        prompt.eos_ids(tok, None, SimpleNamespace(eos_token_id=list(range(65))))


def test_an_end_of_turn_in_generation_config_ends_the_answer(chat_dir: Path, tmp_path: Path) -> None:
    """Oracle: the answer without the rule, cut where the token the rule names first appears."""
    doc = tmp_path / "doc.txt"
    doc.write_text(TEXT, encoding="utf-8")
    free = _ask(_session(chat_dir, max_new_tokens=12), doc).ids
    k = next(i for i in range(1, len(free)) if free[i] not in free[:i])
    stopped_dir = tmp_path / "with-stop"
    shutil.copytree(chat_dir, stopped_dir)
    config = json.loads((stopped_dir / "generation_config.json").read_text())
    end = tiny_tokenizer().eos_token_id
    (stopped_dir / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": [end, free[k]]}))
    session = _session(stopped_dir, max_new_tokens=12)
    assert free[k] in session.eos and free[k] not in _session(chat_dir).eos
    assert _ask(session, doc).ids == free[:k]


# -- base models ------------------------------------------------------------------------------------------------


def _greedy(model, ids: list[int], steps: int, stop: set[int]) -> list[int]:
    out: list[int] = []
    with torch.no_grad():
        for _ in range(steps):
            nxt = int(model(torch.tensor([ids + out])).logits[0, -1].argmax())
            if nxt in stop:
                break
            out.append(nxt)
    return out


def test_a_base_model_is_asked_with_a_plain_prompt(base_dir: Path, tmp_path: Path) -> None:
    """Oracle: transformers' own greedy answer to the document followed by the plain question cue."""
    doc = tmp_path / "doc.txt"
    doc.write_text(TEXT, encoding="utf-8")
    notes: list[str] = []
    session = _session(base_dir, notes)
    assert any("no chat template" in n and "not instruction-tuned" in n for n in notes), notes
    tok = session.tokenizer
    assert prompt.document_prefix(tok) == ""  # the tiny tokenizer puts no start-of-text token first
    suffix = prompt.question_suffix(tok, "What is the pass key?")
    assert suffix == prompt.Rendered(("\n\nQuestion: ", "What is the pass key?", "\nAnswer:"))  # the question apart
    answer = _ask(session, doc)
    expected = _greedy(session.model, encode_text(tok, TEXT) + prompt.encode(tok, suffix), 8, session.eos)
    assert answer.ids == expected
    assert prompt.summary_suffix(tok, "short").text == "\n\nSummary of the text above, in two or three sentences:"


def test_a_base_models_prompt_starts_with_the_start_token_its_tokenizer_adds() -> None:
    from tokenizers import processors

    tok = tiny_tokenizer()
    tok.chat_template = None
    assert prompt.plain_parts(tok, "x") == prompt.PromptParts(prefix="", suffix="x")
    start = tok.convert_tokens_to_ids("<|endoftext|>")
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", start)]
    )
    tok.bos_token = "<|endoftext|>"
    assert prompt.plain_parts(tok, "x").prefix == "<|endoftext|>"


def test_the_cli_answers_a_base_model_with_a_note(base_dir: Path, tmp_path: Path, capsys) -> None:
    doc = tmp_path / "doc.txt"
    doc.write_text(TEXT * 20, encoding="utf-8")
    args = ["--model", str(base_dir), "--budget", "160", "--block-size", "32", "--max-new-tokens", "4"]
    assert main(["ask", str(doc), "What is the pass key?", *args, "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["answers"][0]["question"] == "What is the pass key?"
    assert "tiny-base has no chat template: taken for a base model (not instruction-tuned)" in err
    assert main(["summarize", str(doc), *args, "--quiet"]) == 0
    assert capsys.readouterr().err == ""
