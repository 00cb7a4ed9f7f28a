"""The prompt around a document, split by the model's own chat template.

    prefix   system prompt + user-turn header          fed first (its first tokens are the sinks)
    document streamed block by block
    suffix   question / instruction + turn end + assistant header   fed after the document, pinned

The template is rendered once with a marker where the document goes and split at the marker, so
any chat template works and the prefix does not depend on the question: one prefilled document
serves many questions.
"""

from __future__ import annotations

from dataclasses import dataclass

MARK = "\u2063KVTOOL_DOCUMENT\u2063"

ASK_INSTRUCTION = "\n\nAnswer the question about the text above. Be brief and specific.\nQuestion: {question}"
SUMMARY_LENGTHS = {
    "short": "in two or three sentences",
    "medium": "in one paragraph of about six sentences",
    "long": "in several paragraphs covering the main events, people and ideas",
}
SUMMARY_INSTRUCTION = "\n\nSummarize the text above {length}."


@dataclass
class PromptParts:
    prefix: str
    suffix: str


def split_template(tokenizer, tail: str) -> PromptParts:
    """Render the chat template with the document marker and ``tail`` in the user turn; split it."""
    messages = [{"role": "user", "content": MARK + tail}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if MARK not in text:
        raise ValueError("the chat template dropped the document marker")
    prefix, suffix = text.split(MARK, 1)
    return PromptParts(prefix=prefix, suffix=suffix)


def document_prefix(tokenizer) -> str:
    """The part before the document (identical for every question)."""
    return split_template(tokenizer, "").prefix


def question_suffix(tokenizer, question: str) -> str:
    return split_template(tokenizer, ASK_INSTRUCTION.format(question=question)).suffix


def focus_rows(tokenizer, suffix: str, focus: str) -> slice | None:
    """The rows of ``suffix``'s tokens that encode ``focus`` (the user's question), or None if not found.

    Recall ranks the archive by what these rows attend to: the instruction and the chat template
    around the question are the same for every question, and their rows attend to the document's
    generic attractors (essay titles, dates, turn headers); summed with the question's rows they
    would outrank the passage the question is about, so only the question's rows are used.
    """
    at = suffix.rfind(focus.strip()) if focus.strip() else -1
    if at < 0:
        return None
    start = len(encode(tokenizer, suffix[:at]))
    end = len(encode(tokenizer, suffix[: at + len(focus.strip())]))
    return slice(start, max(end, start + 1))


def summary_suffix(tokenizer, length: str) -> str:
    return split_template(tokenizer, SUMMARY_INSTRUCTION.format(length=SUMMARY_LENGTHS[length])).suffix


def encode(tokenizer, text: str) -> list[int]:
    """Template text already contains its special tokens as text: no extra BOS/EOS."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def eos_ids(tokenizer, model_config=None) -> set[int]:
    """Token ids that end an answer: the tokenizer's EOS, the model's, and the chat turn end."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen_eos = getattr(model_config, "eos_token_id", None) if model_config is not None else None
    if isinstance(gen_eos, int):
        ids.add(gen_eos)
    elif isinstance(gen_eos, list):
        ids.update(int(i) for i in gen_eos)
    for tok in ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "</s>", "<|endoftext|>"):
        tid = tokenizer.convert_tokens_to_ids(tok)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id and tid >= 0:
            ids.add(tid)
    return ids
