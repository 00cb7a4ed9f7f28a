"""The paraphrase needle's calibration screen: candidate wordings run as ``--needle-kind paraphrase`` on dense
attention (``full``) at 1K, three trials per depth, before the kind's wording was fixed.

A needle that shares no word with its question (``none``) is beyond the 135M model even dense; the kept wording
(``cook``: one shared word and a synonym pair) had to be found at least 7 times in 10 by ``full`` at 1K.

    python bench/paraphrase_screen.py NAME [TRIALS]   # resumable: bench/results-runs/paraphrase-screen-NAME.jsonl
"""

from __future__ import annotations

import sys
from pathlib import Path

from defaults import ESSAYS

from kvtool.cli.app import main
from kvtool.eval import needle

HERE = Path(__file__).resolve().parent
#: name → (needle sentence, question); each keeps one shared anchor word or a synonym pair, except ``none``
CANDIDATES = {
    "treaty": ("The peace treaty was signed in the harbour town of {key}.",
               "In which town was the peace agreement concluded?"),
    "captain": ("The old sea captain grew up in a fishing village called {key}.",
                "What was the name of the captain's home village?"),
    "cook": ("Our ship's cook was born in the mountain village of {key}.", "Which village is the chef from?"),
    "orchid": ("The rare blue orchid grows only in the valley of {key}.",
               "In which valley does the blue flower bloom?"),
    "none": ("The treaty was signed in the harbour town of {key}.", "Where was the agreement concluded?"),
}


def screen(name: str, trials: str = "3") -> int:
    """Run one candidate wording (the module's paraphrase text swapped for it, for this process only)."""
    text, question = CANDIDATES[name]
    needle.PARAPHRASE_NEEDLE, needle.PARAPHRASE_QUESTION = text, question
    needle._KIND_TEXT["paraphrase"] = (text, question)
    return main(["eval", "needle", "--haystack", ESSAYS,
                 "--needle-kind", "paraphrase", "--lengths", "1k", "--depths", "0.1,0.5,0.9", "--trials", trials,
                 "--policies", "full", "--budgets", "256", "--max-new-tokens", "16", "--threads", "1",
                 "--resume", str(HERE / "results-runs" / f"paraphrase-screen-{name}.jsonl"), "--json", "--quiet"])


if __name__ == "__main__":
    sys.exit(screen(*sys.argv[1:3]))
