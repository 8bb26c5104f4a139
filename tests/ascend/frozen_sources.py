"""Reading the frozen upstream data of tests/ascend/data: sections headed ``[<tag or branch>] <40-hex commit>``,
then one entry per line; ``#`` comments and blank lines skipped."""

from __future__ import annotations

import re
from pathlib import Path

_HEADER = re.compile(r"^\[(\S+)\] [0-9a-f]{40}$")


def sections(path: Path) -> dict[str, list[str]]:
    """tag -> the section's entry lines, in file order."""
    out: dict[str, list[str]] = {}
    tag = None
    for line in path.read_text().splitlines():
        if line.startswith("#") or not line.strip():
            continue
        m = _HEADER.match(line)
        if m:
            tag = m.group(1)
            out[tag] = []
        else:
            out[tag].append(line)
    return out
