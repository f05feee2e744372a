"""Library size by package: lines, and code lines (no blanks, comments or docstrings).

    python benchmarks/library_lines.py [--rev REV ...] [--name library_lines]

Counts the Python files of `raypaged/` and `kernels/` (the library; benchmarks/ and tests/ are
not) in the working tree and at each git revision given, so a refactor's cut is one command.
Code lines are what the tokenizer finds on a line other than comments, blank lines and string
statements (docstrings): a cut that only deletes explanations does not show there.
"""
from __future__ import annotations

import argparse
import io
import json
import subprocess
import tokenize
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIBRARY = ("raypaged", "kernels")


def code_lines(source: str) -> int:
    lines: set[int] = set()
    prev = tokenize.NEWLINE  # a STRING right after NEWLINE/INDENT/DEDENT starts a docstring
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        kind = tok.type
        if kind in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT,
                    tokenize.DEDENT, tokenize.ENDMARKER, tokenize.ENCODING):
            if kind in (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
                prev = kind
            continue
        docstring = kind == tokenize.STRING and prev in (tokenize.NEWLINE, tokenize.INDENT,
                                                         tokenize.DEDENT)
        if not docstring:
            lines.update(range(tok.start[0], tok.end[0] + 1))
        prev = kind
    return len(lines)


def package_of(path: str) -> str:
    parts = path.split("/")
    return "/".join(parts[:2]) if len(parts) > 2 else parts[0]


def files_at(rev: str | None) -> dict[str, str]:
    if rev is None:
        return {str(p.relative_to(ROOT)): p.read_text() for top in LIBRARY
                for p in sorted((ROOT / top).rglob("*.py"))}
    names = subprocess.run(["git", "ls-tree", "-r", "--name-only", rev, *LIBRARY], cwd=ROOT,
                           check=True, capture_output=True, text=True).stdout.split()
    return {n: subprocess.run(["git", "show", f"{rev}:{n}"], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout
            for n in names if n.endswith(".py")}


def count(rev: str | None) -> dict[str, dict[str, int]]:
    table: dict[str, dict[str, int]] = defaultdict(lambda: {"files": 0, "lines": 0, "code": 0})
    for path, source in files_at(rev).items():
        for key in (package_of(path), "total"):
            row = table[key]
            row["files"] += 1
            row["lines"] += len(source.splitlines())
            row["code"] += code_lines(source)
    return dict(table)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", nargs="*", default=[], help="git revisions to count beside the tree")
    ap.add_argument("--name", default="library_lines")
    args = ap.parse_args()
    columns = {rev: count(rev) for rev in args.rev}
    columns["tree"] = count(None)
    packages = sorted({p for c in columns.values() for p in c if p != "total"}) + ["total"]
    print(f"{'package':22}" + "".join(f"{rev[:10]:>22}" for rev in columns))
    print(f"{'':22}" + "".join(f"{'lines / code':>22}" for _ in columns))
    for p in packages:
        cells = [c.get(p, {"lines": 0, "code": 0}) for c in columns.values()]
        print(f"{p:22}" + "".join(f"{c['lines']:>14} / {c['code']:>5}" for c in cells))
    out = ROOT / "benchmarks" / "results" / f"{args.name}.json"
    out.write_text(json.dumps(columns, indent=1, sort_keys=True) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
