#!/usr/bin/env bash
# The README's install as a newcomer runs it: a fresh venv with the stock pip of the oldest Python found
# (never upgraded: old pips resolve extras differently), torch's CPU build first as the README says, then
# the README's own install command as written, then one document of every format read by the installed
# kvtool, and one question answered end to end with the embedded model.
#
#   FRESH_PYTHON=python3.10 bash scripts/fresh-install-check.sh   # another interpreter
#   DEV_PYTHON=.venv/bin/python                                   # makes the documents (fpdf2, python-docx)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
DEV_PY=${DEV_PYTHON:-$ROOT/.venv/bin/python}

PY=${FRESH_PYTHON:-}
if [ -z "$PY" ]; then
  for v in 3.10 3.11 3.12 3.13; do  # the oldest the project supports first (requires-python >= 3.10)
    if command -v "python$v" >/dev/null 2>&1 && "python$v" -c "" 2>/dev/null; then PY=python$v; break; fi
  done
fi
PY=${PY:-python3}
VERSION=$("$PY" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])')
case "$VERSION" in
  3.10.*) ;;
  *) echo "fresh install: note: no Python 3.10 on PATH; checking with the oldest found, $VERSION" >&2 ;;
esac

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
"$PY" -m venv "$WORK/venv"  # pip as ensurepip bundles it with this Python
. "$WORK/venv/bin/activate"
echo "fresh install: Python $VERSION, $(pip --version | cut -d' ' -f1-2)" >&2

if ls "${PIP_FIND_LINKS:-/nonexistent}"/torch-2.13.0+cpu-*.whl >/dev/null 2>&1; then
  pip install --quiet "torch==2.13.0"                                      # the CPU wheel on local disk
else
  pip install --quiet torch --index-url https://download.pytorch.org/whl/cpu  # as README's Install says
fi

# The README's own install command, as written: the first line of the bash block under "## Install".
CMD=$(awk '/^## Install/ {found = 1} found && /^```bash/ {getline; print; exit}' README.md)
[ -n "$CMD" ] || { echo "fresh install: no install command under '## Install' in README.md" >&2; exit 1; }
echo "fresh install: + $CMD" >&2
bash -c "$CMD" >"$WORK/install.log" 2>&1 || { tail -20 "$WORK/install.log" >&2; exit 1; }

# One document of every format, made by the development venv (fpdf2 and python-docx are test tools).
"$DEV_PY" - "$WORK/docs" <<'PYEOF'
import sys
from pathlib import Path

sys.path.insert(0, ".")
from tests.doc_fixtures import ARTICLE, CHAPTERS, PAGES, make_docx, make_epub, make_html, make_pdf

out = Path(sys.argv[1])
out.mkdir()
make_pdf(out / "doc.pdf", PAGES)
make_epub(out / "doc.epub", CHAPTERS)
make_docx(out / "doc.docx", CHAPTERS)
make_html(out / "doc.html", ARTICLE)
(out / "doc.md").write_text("# Notes\n\n" + " ".join(p for p in PAGES) + "\n", encoding="utf-8")
(out / "doc.txt").write_text(" ".join(ARTICLE) + "\n", encoding="utf-8")
PYEOF

# Read them with the installed kvtool, from outside the repository (so the installed copy is imported).
cd "$WORK"
python - "$WORK/docs" <<'PYEOF'
import sys
from pathlib import Path

import kvtool
from kvtool.documents import extract_text

assert "site-packages" in kvtool.__file__, kvtool.__file__
expect = {"pdf": "green ledger", "epub": "seven apple trees", "docx": "seven apple trees",
          "html": "seventy thousand", "md": "copper wire", "txt": "arctic terns"}
for ext, words in expect.items():
    text = extract_text(str(Path(sys.argv[1]) / f"doc.{ext}"), 10**6)
    assert words in text, (ext, text[:200])
    print(f"fresh install: read doc.{ext} ({len(text)} characters)", file=sys.stderr)
PYEOF
KVTOOL_HOME="$WORK/home" kvtool ask "$WORK/docs/doc.html" "How far do the terns fly?" --max-new-tokens 8 -q >/dev/null
echo "fresh install: ok (Python $VERSION, every format read, one question answered with the embedded model)" >&2
