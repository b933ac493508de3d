"""The lines of Python each phase adds to tinyvllm/, by docs/modules.md's phase column (tests/phases.py).

`lines` counts every line of a module; `code` leaves out blank lines, comment lines and docstrings. The table
in docs/modules.md ("Lines per phase") is this script's output, and tests/test_phase_lines.py checks it.

    python tests/phase_lines.py           # print the table
    python tests/phase_lines.py --write   # and write it into docs/modules.md
"""

from __future__ import annotations

import io
import re
import sys
import tokenize

from phases import MODULE_MAP, ROOT, module_phases
from prose_share import docstring_nodes

BEGIN, END = "<!-- phase lines: begin -->", "<!-- phase lines: end -->"


def code_lines(source: str) -> int:
    """The lines of `source` holding code: not blank, not only a comment, not part of a docstring."""
    docstring_lines = {line for node in docstring_nodes(source) for line in range(node.lineno, node.end_lineno + 1)}
    code: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                            tokenize.ENDMARKER):
            code.update(range(tok.start[0], tok.end[0] + 1))
    return len(code - docstring_lines)


def lines_per_phase() -> dict[int, tuple[int, int, int]]:
    """phase -> (modules, lines, code lines) over the modules docs/modules.md gives that phase."""
    phases = module_phases()
    table: dict[int, tuple[int, int, int]] = {}
    for path in sorted((ROOT / "tinyvllm").rglob("*.py")):
        name = str(path.relative_to(ROOT)).removesuffix(".py").removesuffix("/__init__").replace("/", ".")
        phase = phases.get(name, 1)  # tinyvllm/__init__.py: the package itself, Phase 1
        source = path.read_text(encoding="utf-8")
        modules, lines, code = table.get(phase, (0, 0, 0))
        table[phase] = (modules + 1, lines + len(source.splitlines()), code + code_lines(source))
    return dict(sorted(table.items()))


def markdown() -> str:
    rows = ["| phase | modules | lines | code lines | Phases 1..k: lines | Phases 1..k: code lines |",
            "|---|---|---|---|---|---|"]
    total_lines = total_code = 0
    for phase, (modules, lines, code) in lines_per_phase().items():
        total_lines, total_code = total_lines + lines, total_code + code
        rows.append(f"| {phase} | {modules} | {lines:,} | {code:,} | {total_lines:,} | {total_code:,} |")
    return "\n".join(rows)


def written(text: str) -> str:
    """docs/modules.md's text with the table between the markers replaced by the current one."""
    pattern = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END), re.S)
    if not pattern.search(text):
        raise ValueError(f"{MODULE_MAP} lacks the markers {BEGIN} ... {END}")
    return pattern.sub(lambda _: f"{BEGIN}\n{markdown()}\n{END}", text)


if __name__ == "__main__":
    print(markdown())
    if "--write" in sys.argv[1:]:
        MODULE_MAP.write_text(written(MODULE_MAP.read_text(encoding="utf-8")), encoding="utf-8")
