"""Rewrite citations of documents that do not ship with gpattn into citations a reader can follow.

The package cites its mathematics as ``docs/derivations.md §N`` and the papers by author, section and
equation. Older text cited the team's specification (``MATH.md §N``), the paper texts by their file
numbers (``seed 004 §3.2``), the specification's labels (``Decision``, ``Peer code``) and the design
notes and issue tracker. :data:`RULES` is the mapping, applied in order; the script prints a unified
diff of what it would change (dry run, the default) and writes only with ``--write``. ``--check``
lists, after the mapping, what it cannot rewrite on its own (a ``DESIGN.md``, an issue number inside a
sentence, ...), for a person to edit.

Usage::

    python tools/recite.py gpattn/attention gpattn/variational            # diff only
    python tools/recite.py --write gpattn/attention gpattn/variational    # apply
    python tools/recite.py --check gpattn tests                           # what is left to edit by hand
"""

from __future__ import annotations

import argparse
import difflib
import pathlib
import re
import sys

#: paper by the number of its text file (001 … 004), for a plain citation and a possessive
PAPERS = {
    "1": ("Pei et al.", "Pei et al.'s"),
    "2": ("Chen et al. (2024)", "Chen et al.'s (2024)"),
    "3": ("Bui et al.", "Bui et al.'s"),
    "4": ("Chen & Li (2023)", "Chen & Li's (2023)"),
}

#: (pattern, replacement), applied in this order; a replacement may be a function of the match
RULES: list[tuple[str, object]] = [
    # the specification: its sections keep their numbers in docs/derivations.md
    (r"`?\.\./shared/docs/MATH\.md`?(?: of the team repository)?", "[docs/derivations.md](docs/derivations.md)"),
    (r'\bMATH\.md "Peer code"', 'docs/derivations.md "Released code differs"'),
    (r'\bMATH\.md "Decision"', 'docs/derivations.md "Choice"'),
    (r"\bMATH(?:\.md)?(?=\s*§)", "docs/derivations.md"),
    (r"\bMATH\.md\b", "docs/derivations.md"),
    # the specification's labels
    (r"\*\*Decision\*\*", "**Choice**"),
    (r"\bDecision\b", "Choice"),
    (r"\*\*Peer code\*\* (?=[a-z])", "the released code "),  # "(**Peer code** masks after ...)"
    (r"\*\*Peer code\*\*", "**Released code differs**"),
    (r"\bPeer code\b", "Released code differs"),
    # the paper texts by file number (random seeds, "seed 0", never match: the numbers are 001-004)
    (r"\bseed 004 / Chen & Li,? (?:\(2023\)|2023)", PAPERS["4"][0]),
    (r"\bseed 004; (Chen & Li, ICLR 2023)", r"\1"),
    (r"\b[Ss]eeds 002[–-]004\b", "the GP-attention papers"),
    (r"\b[Ss]eeds 003/004\b", "Bui et al. and Chen & Li (2023)"),
    (r"\b[Ss]eed 00([1-4])'s\b", lambda m: PAPERS[m.group(1)][1]),
    (r"\b[Ss]eeds?[ -]00([1-4])\b", lambda m: PAPERS[m.group(1)][0]),
    # "Bui et al. §2.3, 004 §3.1": a second file number in the same citation
    (
        r"((?:Pei et al\.|Chen et al\. \(2024\)|Bui et al\.|Chen & Li \(2023\))[^,;()\n]*[,;]\s+)00([1-4])\b",
        lambda m: m.group(1) + PAPERS[m.group(2)][0],
    ),
    # authors are plural: "Pei et al. uses" -> "Pei et al. use"
    (
        r"((?:Pei et al\.|Chen et al\. \(2024\)|Bui et al\.|Chen & Li \(2023\)) )"
        r"(use|do|report|say|state|replace|give|list|note|choose|leave|drop|set)(e?s)\b",
        r"\1\2",
    ),
    (r"\b([Tt])he seeds'", r"\1he papers'"),
    (r"\b([Tt])he seeds\b", r"\1he papers"),
    # design notes and the issue tracker, where they are a parenthetical inside a line that can simply go
    (r"(?<=\S) \([Ii]ssue \d+(?: item \d+)?\)", ""),
    (r'(?<=\S) \((?:DESIGN\.md(?: "[^"]*")?|STYLE\.md(?: \d+)?)(?:; (?:DESIGN\.md(?: "[^"]*")?|STYLE\.md(?: \d+)?))*\)',
     ""),
]

#: what the rules leave for a person: non-shipping documents and issue numbers inside a sentence
LEFT_FOR_HAND = re.compile(
    r"MATH\.md|MATH §|\b[Ss]eeds?[ -]00[1-4]\b|\b00[1-4] §|Decision|Peer code|DESIGN\.md|STYLE\.md"
    r"|\b[Ii]ssues?[ -]\d+|#\d{2,}\b|\bseed's text|\bthe seed\b(?! \d)"
)

SUFFIXES = {".py", ".md", ".txt", ".rst", ".toml", ".cfg"}


def recite(text: str) -> str:
    """``text`` with every rule of :data:`RULES` applied, in order."""
    for pattern, replacement in RULES:
        previous = None
        while previous != text:  # the second-citation rule may chain: "…, 003 …, 004 …"
            previous, text = text, re.sub(pattern, replacement, text)
    return text


def files_under(paths: list[str]) -> list[pathlib.Path]:
    """The text files named or under the directories named, sorted."""
    found: list[pathlib.Path] = []
    for name in paths:
        path = pathlib.Path(name)
        if path.is_dir():
            found.extend(p for p in sorted(path.rglob("*")) if p.is_file() and p.suffix in SUFFIXES)
        elif path.is_file():
            found.append(path)
        else:
            raise SystemExit(f"recite.py: {name!r} is neither a file nor a directory; pass paths that exist")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="+", help="files or directories (their .py/.md/... files)")
    parser.add_argument("--write", action="store_true", help="rewrite the files (default: print the diff)")
    parser.add_argument("--check", action="store_true", help="list what the mapping leaves to edit by hand")
    args = parser.parse_args(argv)
    changed = left = 0
    for path in files_under(args.paths):
        old = path.read_text(encoding="utf-8")
        new = recite(old)
        if new != old:
            changed += 1
            if args.write:
                path.write_text(new, encoding="utf-8")
            elif not args.check:
                sys.stdout.writelines(
                    difflib.unified_diff(old.splitlines(True), new.splitlines(True), f"a/{path}", f"b/{path}")
                )
        if args.check:
            for number, line in enumerate(new.splitlines(), 1):
                if LEFT_FOR_HAND.search(line):
                    left += 1
                    print(f"{path}:{number}: {line.strip()}")
    verb = "rewrote" if args.write else "would rewrite"
    print(f"recite.py: {verb} {changed} file(s)" + (f"; {left} line(s) left to edit by hand" if args.check else ""),
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
