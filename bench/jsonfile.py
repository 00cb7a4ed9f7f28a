"""One JSON file written whole: the bench scripts' ``--json`` output (no torch, no kvtool import)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_json(path: str | os.PathLike[str], doc: Any) -> None:
    """``doc`` as indented JSON at ``path``, through a temporary file renamed over it: a run stopped midway
    never leaves a half-written file (a reader sees the previous version or the new one)."""
    out = Path(path)
    part = out.with_name(out.name + ".tmp")
    part.write_text(json.dumps(doc, indent=1))
    os.replace(part, out)
