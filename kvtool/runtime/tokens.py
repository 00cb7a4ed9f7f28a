"""The one place text becomes token ids: data stays text, only the chat template writes control tokens.

A tokenizer called the usual way (``tokenizer(text)``) turns the string ``<|im_end|>`` anywhere in its input
into the control token that ends a chat turn: a document, a web page or a question holding that string
could close the user's turn and open a system turn of its own (role injection). So text is tokenized
in two ways here, and nowhere else:

* :func:`encode_text` for text nobody vouches for: documents in every format, stdin, questions, the eval
  tasks' haystacks. Special tokens are split (``split_special_tokens``): ``<|im_end|>`` becomes the ordinary
  tokens of those characters. Should a tokenizer still make a control token out of plain text (a
  SentencePiece model whose control pieces are matched in text), the text is cut inside that token's
  characters so that it cannot, and refused in one line if even that does not help.
* :func:`encode_prompt` for what the chat template rendered around the user's data. The template's own
  control tokens are found in the template's text alone; every run of text between them (template text and
  data joined, so that tokens merge across the seam as they would in one string) is encoded as plain text.
  For text without special-token strings this gives exactly the ids of tokenizing the whole string.

:func:`special_ids` is what counts as a control token: every added token marked special, and the
tokenizer's named special tokens (BOS, EOS, pad, ...). Added tokens not marked special (some models'
``<think>``, ``<tool_call>``) are ordinary vocabulary and stay matched in text, as in llama.cpp.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, overload

from kvtool.errors import UsageError

Spans = list[tuple[int, int]]
#: the errors a tokenizer raises when it cannot return character offsets (a Python tokenizer)
_NO_OFFSETS = (NotImplementedError, ValueError, TypeError, KeyError)


def special_ids(tokenizer: Any) -> frozenset[int]:
    """The ids of the tokenizer's control tokens: added tokens marked special and its named special tokens."""
    ids = {int(i) for i in tokenizer.all_special_ids}
    ids.update(int(i) for i, tok in tokenizer.added_tokens_decoder.items() if getattr(tok, "special", False))
    return frozenset(ids)


@overload
def encode_text(tokenizer: Any, text: str, offsets: Literal[False] = False) -> list[int]: ...
@overload
def encode_text(tokenizer: Any, text: str, offsets: Literal[True]) -> tuple[list[int], Spans | None]: ...


def encode_text(tokenizer: Any, text: str, offsets: bool = False) -> list[int] | tuple[list[int], Spans | None]:
    """Token ids of untrusted ``text``, with no control token among them (see the module's docstring).

    ``offsets``: also each token's (start, end) character span in ``text``, or None where the tokenizer
    cannot say (a Python tokenizer).
    """
    ids, spans = _checked(tokenizer, text, offsets, False, special_ids(tokenizer))
    return (ids, spans) if offsets else ids


def encode_prompt(tokenizer: Any, pieces: Sequence[str]) -> list[int]:
    """Token ids of a rendered prompt whose ``pieces`` alternate template text and data, template first.

    Control tokens come from the template pieces only (the tokenizer's own parse of each piece, so its
    matching rules hold); the text between two of them, whichever pieces it spans, is plain text.
    """
    specials = special_ids(tokenizer)
    marks: list[tuple[int, int, int]] = []
    at = 0
    for i, piece in enumerate(pieces):
        if i % 2 == 0 and piece:
            marks.extend((at + a, at + b, t) for a, b, t in _controls(tokenizer, piece, specials))
        at += len(piece)
    text = "".join(pieces)
    ids: list[int] = []
    pos = 0
    for a, b, t in [*marks, (len(text), len(text), None)]:
        if a > pos:  # the plain run before this control token (after the previous one: as in mid-string)
            ids.extend(_checked(tokenizer, text[pos:a], False, pos > 0, specials)[0])
        if t is not None:
            ids.append(t)
        pos = b
    return ids


def bos_prefix(tokenizer: Any) -> list[int]:
    """[bos] when the tokenizer puts a BOS token in front of text by default, else []."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return []
    ids = tokenizer("a")["input_ids"]
    return [int(bos)] if ids and ids[0] == bos else []


def _checked(tokenizer: Any, text: str, offsets: bool, mid: bool,
             specials: frozenset[int]) -> tuple[list[int], Spans | None]:
    """``text`` as plain text (``mid``: as in the middle of a string), proven free of control tokens."""
    ids, spans = (_mid if mid else _plain)(tokenizer, text, offsets)
    if not specials.isdisjoint(ids):
        ids, spans = _apart(tokenizer, text, offsets, specials, mid)
    return ids, spans


def _plain(tokenizer: Any, text: str, offsets: bool) -> tuple[list[int], Spans | None]:
    """``text`` tokenized with special tokens split (offsets when asked for and available)."""
    if offsets:
        try:
            enc = tokenizer(text, add_special_tokens=False, split_special_tokens=True, return_offsets_mapping=True)
            return list(enc["input_ids"]), [(int(a), int(b)) for a, b in enc["offset_mapping"]]
        except _NO_OFFSETS:
            pass
    return list(tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]), None


def _apart(tokenizer: Any, text: str, offsets: bool, specials: frozenset[int],
           mid: bool) -> tuple[list[int], Spans | None]:
    """``text`` encoded in pieces cut inside every control token's characters, so none can form.

    For a tokenizer that matches some control tokens in plain text even with special tokens split.
    """
    contents = {tok for tok in tokenizer.convert_ids_to_tokens(sorted(specials)) if isinstance(tok, str) and tok}
    cuts = sorted({i + 1 for c in contents if len(c) > 1 for i in _occurrences(text, c)})
    ids: list[int] = []
    spans: Spans | None = [] if offsets else None
    for start, end in zip([0, *cuts], [*cuts, len(text)], strict=True):
        part = _plain if start == 0 and not mid else _mid
        part_ids, part_spans = part(tokenizer, text[start:end], offsets)
        ids.extend(part_ids)
        if spans is not None and part_spans is not None:
            spans.extend((start + a, start + b) for a, b in part_spans)
        else:
            spans = None
    bad = specials.intersection(ids) - {tokenizer.unk_token_id}  # unknown characters do read as <unk>
    if bad:
        name = tokenizer.convert_ids_to_tokens(min(bad))
        raise UsageError(f"the model's tokenizer makes its control token {str(name)[:40]!r} out of plain text; "
                         "kvtool does not feed it document text")
    return ids, spans


def _occurrences(text: str, needle: str) -> list[int]:
    """Every index where ``needle`` starts in ``text`` (str.find: linear for a fixed needle)."""
    out, i = [], text.find(needle)
    while i >= 0:
        out.append(i)
        i = text.find(needle, i + 1)
    return out


def _mid(tokenizer: Any, text: str, offsets: bool) -> tuple[list[int], Spans | None]:
    """``text`` as plain text in the middle of a string, not at its start.

    A SentencePiece-style tokenizer may put a word-start marker before the first character of a string
    (``prepend_scheme="first"``); in the middle of one it does not. For such a tokenizer ``text`` is encoded
    after a newline whose tokens are then dropped (transformers does the same for its marked chats); any
    other tokenizer, or where the newline merges into ``text``'s first token, encodes ``text`` alone.
    """
    newline = _plain(tokenizer, "\n", False)[0]
    if newline and _marks_string_start(tokenizer, newline):
        ids, spans = _plain(tokenizer, "\n" + text, offsets)
        if ids[: len(newline)] == newline:
            return ids[len(newline):], None if spans is None else [(a - 1, b - 1) for a, b in spans[len(newline):]]
    return _plain(tokenizer, text, offsets)


def _marks_string_start(tokenizer: Any, newline: list[int]) -> bool:
    """Whether "x" at the start of a string tokenizes otherwise than after a newline."""
    after = _plain(tokenizer, "\nx", False)[0]
    return after[: len(newline)] == newline and after[len(newline):] != _plain(tokenizer, "x", False)[0]


def _controls(tokenizer: Any, piece: str, specials: frozenset[int]) -> list[tuple[int, int, int]]:
    """(start, end, id) of each control token the tokenizer parses in template text ``piece``.

    The span covers what the token consumes (the whitespace an added token's ``lstrip``/``rstrip`` eats too).
    """
    try:
        enc = tokenizer(piece, add_special_tokens=False, split_special_tokens=False, return_offsets_mapping=True)
        found = [(int(a), int(b), int(t)) for t, (a, b) in zip(enc["input_ids"], enc["offset_mapping"], strict=True)
                 if int(t) in specials]
    except _NO_OFFSETS:
        found = _controls_by_text(tokenizer, piece, specials)
    added = tokenizer.added_tokens_decoder
    out = []
    for a, b, t in found:
        tok = added.get(t)
        if getattr(tok, "lstrip", False):
            while a > 0 and piece[a - 1].isspace():
                a -= 1
        if getattr(tok, "rstrip", False):
            while b < len(piece) and piece[b].isspace():
                b += 1
        out.append((a, b, t))
    return out


def _controls_by_text(tokenizer: Any, piece: str, specials: frozenset[int]) -> list[tuple[int, int, int]]:
    """Control tokens in ``piece`` by their text, leftmost and longest first (what added-token matching does)."""
    table = {tok: i for i, tok in zip(sorted(specials), tokenizer.convert_ids_to_tokens(sorted(specials)),
                                      strict=True) if isinstance(tok, str) and tok}
    found, at = [], 0
    while at < len(piece):
        hits = [(piece.find(c, at), -len(c), c) for c in table]
        hits = [h for h in hits if h[0] >= 0]
        if not hits:
            break
        start, neg, c = min(hits)
        found.append((start, start - neg, table[c]))
        at = start - neg
    return found
