"""The one line an error becomes on stderr (and in a many-document run's error records).

Lower layers name the setting at fault in their own words (``UsageError.field``: ``budget``, ``block_size``);
the command line speaks in flags, so the line names the flag (``--budget``).
"""

from __future__ import annotations

import re

from kvtool.errors import UsageError, printable

#: how an error raised below the CLI (``UsageError.field``) names its setting, and the flag's spelling
FIELD_FLAGS: dict[str, tuple[tuple[str, str], ...]] = {
    "budget": ((r"^budget (?=\d)", "--budget "), ("raise the budget", "raise --budget"),
               ("lower the budget or the block size", "lower --budget or --block-size"),
               ("a KV budget", "a KV budget (--budget)")),
    "block_size": ((r"^block size", "--block-size"),),
    "sinks": ((r"^sinks and recent", "--sinks and --recent"),),
    "positions": ((r"^positions must", "--positions must"), (r"^compact positions", "--positions compact"),
                  ("use absolute positions", "use --positions absolute")),
    "recall": ((r"^recall must", "--recall must"), ("turn recall off", "use --recall off")),
    "page_size": ((r"^archive page size", "--recall-page"),),
    "policy_opt": (("policy option ", "--policy-opt "),),
}


#: the longest error line printed: whatever a message quotes from a file, the line stays readable
MAX_ERROR_CHARS = 600


def error_line(e: BaseException) -> str:
    """The one line printed for ``e``: a ``UsageError``'s setting named by its command-line flag, controls
    escaped, at most :data:`MAX_ERROR_CHARS` characters."""
    text = str(e)[: 4 * MAX_ERROR_CHARS]
    field = e.field if isinstance(e, UsageError) else None
    for pattern, flag in FIELD_FLAGS.get(field or "", ()):
        text = re.sub(pattern if pattern.startswith("^") else re.escape(pattern), flag, text, count=1)
    line = printable(text, one_line=True)
    return line if len(line) <= MAX_ERROR_CHARS else line[: MAX_ERROR_CHARS - 1] + "…"
