"""Figures in the docs come from results files: check them, or rewrite them from the newest run.

Every bench script writes `benchmarks/results/<script>.json` (`common.write_results`). A figure quoted
from one in README.md, benchmarks/README.md or docs/phases/*.md carries, right after it, an HTML comment
naming the file and the key that holds it (invisible when rendered):

    decode runs at 70.4 tok/s<!-- bench_generate: decode.tok_s -->
    32 requests: 1.49x<!-- bench_throughput: peers.llama_cpp_q4_1.concurrency.32.tinyvllm_ratio -->
    kernel 3.84 ms<!-- bench_kernels: attention.batch=1,context=8192.kernel_ms -->

The key walks the JSON: `a.b` is a field, `3` an index, and `name=value` the one element of a list whose
field `name` equals `value` (`name=value,other=value` when one field is not enough). `KEY*100` or
`KEY/1000` scales the value (a fraction quoted as a percent). The figure is the last number before the
comment on its line, after any earlier comment; it equals the value rounded to the decimals quoted
(commas as thousands separators are fine). A figure that only a measurement can give (tok/s, tokens/s,
GB/s, GFLOP/s, req/s, ms, a ratio like 1.5x) must carry such a comment, or `<!-- derived -->` when it is
arithmetic on the model's shape or on other quoted figures. Fenced code blocks are not checked.

    .venv/bin/python benchmarks/quote_figures.py            # rewrite every referenced figure from its file
    .venv/bin/python benchmarks/quote_figures.py --check    # only report: stale, broken and unreferenced figures

The rewrite keeps each figure's decimals and thousands separators and touches nothing else, so after a
new benchmark run the prose follows the numbers; the words around them are still yours to reread.
`tests/test_docs.py` runs the same checks (it imports this file).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
FIGURE_DOCS = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs" / "phases").glob("*.md"))]

REF = re.compile(r"<!--\s*(\w+):\s*([^\s*/>]+)(?:([*/])(\d+(?:\.\d+)?))?\s*-->")
NUMBER = re.compile(r"(?<![\w.])-?\d[\d,]*(?:\.\d+)?")
# figures that only a measurement can give: these need a reference to a results file
MEASURED = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?\s*(?:tok/s|tokens/s|GB/s|GFLOP/s|req/s|ms\b)"
                      r"|(?<![\w.])\d+(?:\.\d+)?x(?![\w])")
DERIVED = "<!-- derived -->"  # after a figure that is arithmetic on other figures or the model's shape


def lookup(data, key: str):
    """The value at `key` (see the module docstring); AssertionError, KeyError or IndexError if none."""
    for part in key.split("."):
        if isinstance(data, list) and "=" in part:
            wanted = [condition.split("=", 1) for condition in part.split(",")]
            matches = [item for item in data if all(str(item.get(field)) == value for field, value in wanted)]
            assert len(matches) == 1, f"{len(matches)} elements of the list have {part}"
            data = matches[0]
        elif isinstance(data, list):
            data = data[int(part)]
        else:
            assert part in data, f"no key {part!r} (there are: {', '.join(map(str, data))})"
            data = data[part]
    return data


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    out, fence = [], None
    for number, line in enumerate(text.splitlines(), 1):
        opening = re.match(r"^(`{3,})", line)
        if fence is None and opening:
            fence = opening.group(1)
        elif fence is not None and line.rstrip() == fence:
            fence = None
        elif fence is None:
            out.append((number, line))
    return out


@dataclass
class Quote:
    """One reference in the prose and the figure it follows."""
    line: int  # 1-based line number
    ref: re.Match  # the comment, its span in the line
    figure: re.Match | None  # the number it quotes, its span in the line; None if there is none

    @property
    def file(self) -> str:
        return self.ref.group(1)

    @property
    def key(self) -> str:
        return self.ref.group(2)

    @property
    def decimals(self) -> int:
        digits = self.figure.group(0).replace(",", "")
        return len(digits.split(".")[1]) if "." in digits else 0


def quotes(text: str) -> Iterator[Quote]:
    """Every results reference outside code blocks, with the last number before it (after the previous one)."""
    for number, line in prose_lines(text):
        start = 0
        for ref in REF.finditer(line):
            figures = list(NUMBER.finditer(line, start, ref.start()))
            yield Quote(number, ref, figures[-1] if figures else None)
            start = ref.end()


class Results:
    """The results files, each read once; the value a reference names, scaled, or the reason there is none."""

    def __init__(self, results_dir: Path = RESULTS):
        self.dir, self.files = results_dir, {}

    def value(self, quote: Quote) -> float | str:
        path = self.dir / f"{quote.file}.json"
        if path not in self.files:
            self.files[path] = json.loads(path.read_text()) if path.is_file() else None
        if self.files[path] is None:
            return f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path} is missing"
        try:
            value = float(lookup(self.files[path], quote.key))
        except (AssertionError, KeyError, IndexError, ValueError, TypeError) as e:
            return str(e) or type(e).__name__
        op, factor = quote.ref.group(3), quote.ref.group(4)
        if op:
            value = value * float(factor) if op == "*" else value / float(factor)
        return value


def check_figures(text: str, name: str, results_dir: Path = RESULTS) -> list[str]:
    """Every quoted figure against its results file; returns the disagreements, one line each."""
    problems, results = [], Results(results_dir)
    for quote in quotes(text):
        where = f"{name}:{quote.line}: {quote.ref.group(0)}"
        if quote.figure is None:
            problems.append(f"{where}: no number before the reference")
            continue
        value = results.value(quote)
        if isinstance(value, str):
            problems.append(f"{where}: {value}")
            continue
        quoted, decimals = quote.figure.group(0), quote.decimals
        if abs(value - float(quoted.replace(",", ""))) > 0.5 * 10 ** -decimals + 1e-9:
            problems.append(f"{where}: the text says {quoted}, the results file says {value:.{decimals}f}")
    return problems


def unreferenced_figures(text: str, name: str) -> list[str]:
    """Measured-looking figures (tok/s, GB/s, ms, 1.5x, ...) with no results reference after them."""
    problems = []
    for number, line in prose_lines(text):
        for figure in MEASURED.finditer(line):
            rest = line[figure.end():]
            next_number = NUMBER.search(rest)
            comment = re.match(r"[^<]*?(<!--[^>]*-->)", rest)
            before_next = comment is not None and (next_number is None or comment.start(1) < next_number.start())
            if not (before_next and (REF.fullmatch(comment.group(1)) or comment.group(1) == DERIVED)):
                problems.append(f"{name}:{number}: {figure.group(0).strip()!r} names no results file")
    return problems


def formatted(value: float, quoted: str, decimals: int) -> str:
    """`value` written as `quoted` was: the same decimals; thousands separators unless it had 4+ digits without."""
    integer_digits = quoted.lstrip("-").split(".")[0]
    plain = len(integer_digits) >= 4 and "," not in integer_digits
    return f"{value:.{decimals}f}" if plain else f"{value:,.{decimals}f}"


def requote(text: str, results_dir: Path = RESULTS) -> tuple[str, list[tuple[int, str, str, str]]]:
    """The text with every referenced figure rewritten from its results file, and the changes made
    as (line, old, new, reference). References whose value cannot be read are left as they are."""
    lines = text.split("\n")
    edits: dict[int, list[tuple[int, int, str]]] = {}
    changes, results = [], Results(results_dir)
    for quote in quotes(text):
        if quote.figure is None:
            continue
        value = results.value(quote)
        if isinstance(value, str):
            continue
        old = quote.figure.group(0)
        new = formatted(value, old, quote.decimals)
        if new.replace(",", "") != old.replace(",", ""):
            edits.setdefault(quote.line - 1, []).append((*quote.figure.span(), new))
            changes.append((quote.line, old, new, quote.ref.group(0)))
    for index, spans in edits.items():
        line = lines[index]
        for start, end, new in sorted(spans, reverse=True):
            line = line[:start] + new + line[end:]
        lines[index] = line
    return "\n".join(lines), changes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("docs", nargs="*", type=Path, help="Markdown files (default: README.md, benchmarks/README.md, "
                   "docs/phases/*.md)")
    p.add_argument("--check", action="store_true", help="change nothing: report stale, broken and unreferenced "
                   "figures, exit 1 if there are any")
    p.add_argument("--results", type=Path, default=RESULTS, help="the results folder (default benchmarks/results)")
    args = p.parse_args(argv)
    problems = 0
    for doc in args.docs or FIGURE_DOCS:
        doc = doc.resolve()
        name = str(doc.relative_to(ROOT)) if doc.is_relative_to(ROOT) else str(doc)
        text = doc.read_text(encoding="utf-8")
        if not args.check:
            text, changes = requote(text, args.results)
            for line, old, new, ref in changes:
                print(f"{name}:{line}: {old} -> {new}  {ref}")
            if changes:
                doc.write_text(text, encoding="utf-8")
        found = check_figures(text, name, args.results) + unreferenced_figures(text, name)
        for problem in found:
            print(problem, file=sys.stderr)
        problems += len(found)
    if problems:
        print(f"{problems} figure(s) need attention", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
