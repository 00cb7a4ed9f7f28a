"""Data that ships with kvtool: a sample document to try it on (``kvtool sample`` prints its path).

``sample.txt`` is part I of "A Scandal in Bohemia" from Arthur Conan Doyle's *The Adventures of
Sherlock Holmes* (1892, public domain): about 4,800 tokens, read in seconds by the embedded model, and
the default text of ``kvtool eval`` when no corpus is given.
"""

from __future__ import annotations

from pathlib import Path

#: the packaged sample document
SAMPLE = Path(__file__).resolve().with_name("sample.txt")


def sample_path() -> Path:
    """Where the packaged sample document is (installed as package data)."""
    return SAMPLE


if __name__ == "__main__":
    print(SAMPLE)
