"""The README, the request's walk through the code (docs/request-lifecycle.md) and the
benchmarks' index name the files a newcomer opens next: every source file they name exists.
(The measurement logs in docs/ may name files of the commits they measured.)

A name in backticks ending in .py or .cpp (the first word of the span) must be a file of the
checkout: as written from the repository root, or under raypaged/ (`serve/worker.py`), or, for
a bare name (`frontend.py`), somewhere in the tree. A file renamed or deleted without its docs
fails here, naming the document and the stale name.
"""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", ROOT / "docs" / "request-lifecycle.md",
             ROOT / "benchmarks" / "README.md"]
NAMED = re.compile(r"`([A-Za-z0-9_./-]+\.(?:py|cpp))(?:[\s:`])")
SKIP = {".venv", ".git", ".tools", "node_modules"}


def _tree_names() -> set[str]:
    return {p.name for p in ROOT.rglob("*.py") if not SKIP & set(p.parts)} | \
           {p.name for p in ROOT.rglob("*.cpp") if not SKIP & set(p.parts)}


def _exists(name: str, bare: set[str]) -> bool:
    if "/" not in name:
        return name in bare
    return any((base / name).is_file()
               for base in (ROOT, ROOT / "raypaged", ROOT / "raypaged" / "serve",
                            ROOT / "benchmarks"))


def test_every_source_file_the_docs_name_exists():
    bare = _tree_names()
    stale = [f"{doc.relative_to(ROOT)}: {name}"
             for doc in DOCUMENTS for name in sorted(set(NAMED.findall(doc.read_text())))
             if not _exists(name, bare)]
    assert stale == []
