"""The prompt around a document, split by the model's own chat template.

    prefix   system prompt + user-turn header          fed first (its first tokens are the sinks)
    document streamed block by block
    suffix   question / instruction + turn end + assistant header   fed after the document, pinned

The template is rendered once with a marker where the document goes and split at the marker, so
any chat template works and the prefix does not depend on the question: one prefilled document
serves many questions. The question is data like the document: the template is rendered with a second
marker in its place and the question put there afterwards, so the template never sees it and
:func:`encode` knows which characters are the user's (plain text, never control tokens; see
:mod:`kvtool.runtime.tokens`).

A checkpoint without a chat template is a base model (not instruction-tuned): it gets a plain
prompt instead, a completion cue after the document (``Question: … Answer:``, or a summary's
heading) that a model trained only to continue text continues with the answer.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from kvtool.errors import UsageError, first_line
from kvtool.runtime.tokens import bos_prefix, encode_prompt

MARK = "\u2063KVTOOL_DOCUMENT\u2063"
QUESTION_MARK = "\u2063KVTOOL_QUESTION\u2063"

ASK_INSTRUCTION = "\n\nAnswer the question about the text above. Be brief and specific.\nQuestion: {question}"
SUMMARY_LENGTHS = {
    "short": "in two or three sentences",
    "medium": "in one paragraph of about six sentences",
    "long": "in several paragraphs covering the main events, people and ideas",
}
SUMMARY_INSTRUCTION = "\n\nSummarize the text above {length}."
#: a base model's cues after the document: text it continues with the answer
PLAIN_QUESTION = "\n\nQuestion: {question}\nAnswer:"
PLAIN_SUMMARY = "\n\nSummary of the text above, {length}:"


@dataclass
class PromptParts:
    prefix: str
    suffix: str


@dataclass(frozen=True)
class Rendered:
    """Rendered prompt text whose ``pieces`` alternate the template's text and the user's data (the
    question), template first: only template pieces may hold control tokens."""

    pieces: tuple[str, ...]

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def cut(self, end: int) -> Rendered:
        """The first ``end`` characters, their pieces kept apart."""
        out, at = [], 0
        for piece in self.pieces:
            out.append(piece[: max(0, end - at)])
            at += len(piece)
        return Rendered(tuple(out))


#: a chat template (the model's own code, in Jinja's sandbox) may run this long per rendering ...
TEMPLATE_SECONDS = 10.0
#: ... write at most this many characters besides the message it is given ...
TEMPLATE_CHARS = 1 << 20
#: ... and raise the process's peak memory by at most this much
TEMPLATE_GROWTH_BYTES = 256 << 20


class TemplateLimit(Exception):
    """A chat template went past one of the caps above (the message says which)."""


def split_template(tokenizer, tail: str) -> PromptParts:
    """Render the chat template with the document marker and ``tail`` in the user turn; split it.

    The template must keep the message, once: the document is streamed at the marker's place.
    """
    messages = [{"role": "user", "content": MARK + tail}]
    text = render_chat(tokenizer, messages)
    if text.count(MARK) != 1:
        what = "drops the user's message" if MARK not in text else "repeats the user's message"
        raise UsageError(f"the model's chat template {what}: kvtool streams the document once, where the "
                         "message goes (fix the template in tokenizer_config.json or chat_template.jinja)")
    prefix, suffix = text.split(MARK, 1)
    return PromptParts(prefix=prefix, suffix=suffix)


def render_chat(tokenizer, messages: list[dict[str, str]]) -> str:
    """``apply_chat_template`` (text, with the generation prompt) under a time, output and memory cap.

    A chat template is code from the model directory, run in Jinja's sandbox: nested loops can run for
    hours or fill memory, and a template may raise on purpose or trip the sandbox. Each of those is one
    ``UsageError`` naming what the template did; nothing it does reaches the user as a traceback.
    """
    budget = TEMPLATE_CHARS + 2 * sum(len(m.get("content", "")) for m in messages)
    try:
        with _template_limits(_compiled_template(tokenizer), budget):
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except TemplateLimit as e:
        raise UsageError(f"the model's chat template {e}; refused") from None
    except UsageError:
        raise
    except RecursionError:
        raise UsageError("the model's chat template recurses too deeply") from None
    except Exception as e:  # TemplateError (raise_exception, a syntax error), SecurityError (the sandbox), any other
        raise UsageError(f"the model's chat template fails: {type(e).__name__}: {first_line(e, 200)}") from None
    if not isinstance(text, str):
        raise UsageError(f"the model's chat template renders {type(text).__name__}, not text")
    return text


def _compiled_template(tokenizer) -> Any:
    """The compiled Jinja template ``apply_chat_template`` will use (transformers caches it), or None."""
    with contextlib.suppress(Exception):
        from transformers.utils.chat_template_utils import _compile_jinja_template

        return _compile_jinja_template(tokenizer.get_chat_template())
    return None


@contextlib.contextmanager
def _template_limits(compiled: Any, max_chars: int) -> Iterator[None]:
    """Enforce the caps while a template renders.

    Output: the template's own ``environment.concat`` (what joins its output) counts characters as they
    come. Time and memory: a trace function on the template's compiled code (filename ``<template>``) checks
    the clock and the peak RSS at every line it runs (a real template runs a few hundred), so a loop that
    writes nothing, or a string that doubles at each step, is stopped within a step.
    """
    started = time.monotonic()
    base = _peak_rss()

    def check() -> None:
        if time.monotonic() - started > TEMPLATE_SECONDS:
            raise TemplateLimit(f"runs longer than {TEMPLATE_SECONDS:.0f} s")
        if base is not None and (_peak_rss() or 0) - base > TEMPLATE_GROWTH_BYTES:
            raise TemplateLimit(f"takes more than {TEMPLATE_GROWTH_BYTES >> 20} MiB of memory")

    def local(frame: Any, event: str, arg: Any) -> Any:
        if event == "line":
            check()
        return local

    def calls(frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code.co_filename != "<template>":
            return None
        check()
        return local

    def concat(pieces: Iterable[str]) -> str:
        out, size = [], 0
        for piece in pieces:
            size += len(piece)
            if size > max_chars:
                raise TemplateLimit(f"writes more than {max_chars:,} characters")
            out.append(piece)
        return "".join(out)

    env = getattr(compiled, "environment", None)
    if env is not None:
        env.concat = concat
    previous = sys.gettrace()
    sys.settrace(calls)
    try:
        yield
    finally:
        sys.settrace(previous)
        if env is not None:
            with contextlib.suppress(AttributeError):
                del env.concat  # back to the class's own join


def _peak_rss() -> int | None:
    """The process's peak resident memory in bytes (None where the platform does not say)."""
    try:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    except (ImportError, OSError, AttributeError):
        return None
    return peak if sys.platform == "darwin" else peak * 1024


def has_chat_template(tokenizer) -> bool:
    """Whether the checkpoint brings a chat template (an instruction-tuned model); without one, a plain prompt."""
    return bool(getattr(tokenizer, "chat_template", None))


def base_model_note(name: str) -> str:
    """The one line that says a model without a chat template is asked with a plain prompt."""
    return (f"note: {name} has no chat template: taken for a base model (not instruction-tuned) and asked with a "
            "plain prompt (the document, then \"Question: ... Answer:\")")


def plain_parts(tokenizer, tail: str) -> PromptParts:
    """A base model's prompt: the tokenizer's own start-of-text token (where it puts one), the document, ``tail``."""
    bos = getattr(tokenizer, "bos_token", None)
    starts = isinstance(bos, str) and bool(bos) and bool(bos_prefix(tokenizer))
    return PromptParts(prefix=bos if starts else "", suffix=tail)


def _parts(tokenizer, chat_tail: str, plain_tail: str) -> PromptParts:
    if has_chat_template(tokenizer):
        return split_template(tokenizer, chat_tail)
    return plain_parts(tokenizer, plain_tail)


def document_prefix(tokenizer) -> str:
    """The part before the document (identical for every question)."""
    return _parts(tokenizer, "", "").prefix


def question_suffix(tokenizer, question: str) -> Rendered:
    """The suffix of a question: the template (or a base model's plain cue) rendered around a marker, the
    question (stripped) put in its place, so that the template never sees it and it stays data."""
    suffix = _parts(tokenizer, ASK_INSTRUCTION.format(question=QUESTION_MARK),
                    PLAIN_QUESTION.format(question=QUESTION_MARK)).suffix
    if suffix.count(QUESTION_MARK) != 1:
        raise UsageError("the model's chat template rewrites the user's message: kvtool puts the question where "
                         "the message goes (fix the template in tokenizer_config.json or chat_template.jinja)")
    before, after = suffix.split(QUESTION_MARK)
    return Rendered((before, question.strip(), after))


def focus_rows(tokenizer, suffix: Rendered, focus: str) -> slice | None:
    """The rows of ``suffix``'s tokens that encode ``focus`` (the user's question), or None if not found.

    Recall ranks the archive by what these rows attend to: the instruction and the chat template
    around the question are the same for every question, and their rows attend to the document's
    generic attractors (essay titles, dates, turn headers); summed with the question's rows they
    would outrank the passage the question is about, so only the question's rows are used.
    """
    at = suffix.text.rfind(focus.strip()) if focus.strip() else -1
    if at < 0:
        return None
    start = len(encode(tokenizer, suffix.cut(at)))
    end = len(encode(tokenizer, suffix.cut(at + len(focus.strip()))))
    return slice(start, max(end, start + 1))


def summary_suffix(tokenizer, length: str) -> Rendered:
    return Rendered((_parts(tokenizer, SUMMARY_INSTRUCTION.format(length=SUMMARY_LENGTHS[length]),
                            PLAIN_SUMMARY.format(length=SUMMARY_LENGTHS[length])).suffix,))


def prefix_ids(tokenizer) -> list[int]:
    """The token ids of the part before the document (template text only)."""
    return encode(tokenizer, Rendered((document_prefix(tokenizer),)))


def encode(tokenizer, prompt: Rendered) -> list[int]:
    """Token ids of rendered prompt text: the template's control tokens as written, the user's data as plain
    text. The template writes its own BOS where it wants one: none is added."""
    return encode_prompt(tokenizer, prompt.pieces)


#: the most end-of-answer ids a model's configs may list (real ones list one to three)
MAX_STOP_IDS = 64
#: chat turn ends known by name (ChatML, Llama 3, Gemma, Llama 2 / Mistral, GPT-2 style)
TURN_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<end_of_turn>", "</s>", "<|endoftext|>")


def eos_ids(tokenizer, model_config=None, generation_config=None) -> set[int]:
    """Token ids that end an answer: the tokenizer's EOS, the model's, and the chat turn end.

    The model's come from its config and from its ``generation_config.json`` (transformers reads it as
    JSON, within the checkpoint's file caps, and runs nothing): ``eos_token_id`` is one id or a list, e.g.
    Llama 3 Instruct's ``<|eot_id|>`` beside ``<|end_of_text|>``, Gemma's ``<end_of_turn>`` beside ``<eos>``.
    """
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    for where, config in (("config.json", model_config), ("generation_config.json", generation_config)):
        ids.update(_config_stop_ids(where, getattr(config, "eos_token_id", None) if config is not None else None))
    for tok in TURN_END_TOKENS:
        tid = tokenizer.convert_tokens_to_ids(tok)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id and tid >= 0:
            ids.add(tid)
    return ids


def _config_stop_ids(where: str, value: Any) -> set[int]:
    """``eos_token_id`` of a config (an id, a list of ids or nothing) as a set; other entries are ignored."""
    items = [value] if isinstance(value, int) else list(value) if isinstance(value, list | tuple) else []
    if len(items) > MAX_STOP_IDS:
        raise UsageError(f"the model's {where} lists {len(items):,} end-of-answer token ids (eos_token_id), more "
                         f"than the {MAX_STOP_IDS} any real model needs; refused")
    return {int(i) for i in items if isinstance(i, int) and not isinstance(i, bool) and i >= 0}
