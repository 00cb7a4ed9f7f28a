"""Documents as a stream of token blocks: the parts of :mod:`kvtool.documents`, tokenized as they come.

The whole document is never held as tokens: its reader hands out parts of at most 64K characters
(pages, chapters, sections, text pieces cut before a space), which are tokenized as the prefill reaches
them and handed out in blocks. Each token's character span in the extracted text can be recorded on
the way (a :class:`~kvtool.runtime.citations.SourceMap`, for citations). Document text is data: it is
tokenized as plain text (:func:`~kvtool.runtime.tokens.encode_text`), so the string ``<|im_end|>`` in it is
never the control token that ends a chat turn.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from kvtool.documents import Document, iter_parts
from kvtool.runtime.tokens import encode_text

if TYPE_CHECKING:
    from kvtool.runtime.citations import SourceMap

if TYPE_CHECKING:  # torch is imported where tokens are made: a bad path fails before torch loads (~10 s)
    from torch import Tensor


def iter_token_blocks(doc: Document, tokenizer, block_size: int, source: SourceMap | None = None) -> Iterator[Tensor]:
    """Token blocks of exactly ``block_size`` (the last may be shorter), streamed from the parts.

    With ``source``, each token's character span in the extracted text and its part (page, chapter,
    section) are recorded as the token is handed out.
    """
    import torch

    buf: list[int] = []
    for part in iter_parts(doc):
        text = part.text
        if source is not None:
            ids, spans = _tokenize_spans(tokenizer, text, doc.chars)
            source.add_section(doc.chars, part.page, part.chapter, part.title)
            source.add(ids, spans)
        else:
            ids = encode_text(tokenizer, text)
        doc.chars += len(text)
        doc.tokenized_tokens += len(ids)
        buf.extend(ids)
        while len(buf) >= block_size:
            block, buf = buf[:block_size], buf[block_size:]
            doc.tokens += len(block)
            yield torch.tensor(block, dtype=torch.long)
    if buf:
        doc.tokens += len(buf)
        yield torch.tensor(buf, dtype=torch.long)


def rechunk(pieces: Iterable[Tensor], size: int) -> Iterator[Tensor]:
    """Regroup token tensors into blocks of exactly ``size`` (the last may be shorter)."""
    import torch

    buf: list[Tensor] = []
    have = 0
    for t in pieces:
        buf.append(t)
        have += t.numel()
        while have >= size:
            flat = torch.cat(buf)
            yield flat[:size]
            rest = flat[size:]
            buf, have = ([rest] if rest.numel() else []), rest.numel()
    if have:
        yield torch.cat(buf)


def _tokenize_spans(tokenizer, text: str, base: int) -> tuple[list[int], list[tuple[int, int]]]:
    """Token ids and each token's (start, end) character span, offset by ``base``.

    Fast tokenizers give exact offsets; otherwise spans come from the lengths of decoded prefixes.
    """
    ids, offsets = encode_text(tokenizer, text, offsets=True)
    if offsets is not None:
        return ids, [(base + a, base + b) for a, b in offsets]
    spans, at = [], 0
    for i in ids:  # approximate: each token's own decoded length
        end = min(len(text), at + len(tokenizer.decode([i])))
        spans.append((base + at, base + end))
        at = end
    return ids, spans


def estimate_tokens(doc: Document) -> int | None:
    """Expected token count: tokens so far over the share of the source read so far, refined as reading proceeds.

    The share is a byte fraction (bytes of text handed out over the file's size; for other formats the
    reader's own measure: bytes inflated, pages, extracted characters), so a document read as a single
    part is estimated as well as one of many. Unknown (stdin text) until the end: ``None``.
    """
    if doc.fraction and doc.tokenized_tokens:
        return max(doc.tokens, int(doc.tokenized_tokens / doc.fraction))
    if doc.fmt in ("text", "markdown") and doc.size:
        return max(1, doc.size // 4)
    return None
