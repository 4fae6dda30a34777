"""The journey of docs/slurm.md as a script: its marked bash blocks, in order.

A block is marked by the HTML comment before it, `<!-- journey NAME -->` (run as written) or
`<!-- journey NAME: not run ... (REASON): WHAT INSTEAD -->` (not run here: the journey calls
`journey_instead_NAME`, which tests/journey/steps.sh defines, in its place). The script calls
`journey_before NAME` before and `journey_after NAME` after each block (steps.sh's checks).

    python tests/journey/blocks.py docs/slurm.md > journey.sh
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

MARK = re.compile(r"<!-- journey (?P<name>[a-z][a-z-]*)(?:: (?P<instead>not run[^>]*?))? -->\n```bash\n(?P<code>.*?)```",
                  re.S)


@dataclass(frozen=True)
class Block:
    name: str
    code: str
    instead: str | None  # why the block does not run here, and what runs in its place; None: runs as written


def blocks(markdown: str) -> list[Block]:
    """The marked blocks, in the order of the page. ValueError for a mark no bash block follows,
    and for a name used twice."""
    found = [Block(m["name"], m["code"], m["instead"]) for m in MARK.finditer(markdown)]
    marks = re.findall(r"<!-- journey ", markdown)
    if len(marks) != len(found):
        raise ValueError(f"{len(marks)} journey marks but {len(found)} of them are followed by a ```bash block")
    names = [b.name for b in found]
    if len(set(names)) != len(names):
        raise ValueError(f"a journey step is named twice: {names}")
    return found


def script(markdown: str) -> str:
    """The bash script of the journey (for steps.sh's functions to be defined first)."""
    lines = []
    for b in blocks(markdown):
        name = b.name.replace("-", "_")
        lines.append(f"journey_before {b.name}")
        if b.instead is None:
            lines.append(b.code.rstrip("\n"))
        else:
            lines.append(f"journey_instead_{name}  # {b.instead}")
        lines.append(f"journey_after {b.name}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(script(Path(sys.argv[1]).read_text()))
