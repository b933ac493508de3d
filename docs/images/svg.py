"""The SVG of the chapters' figures, written by hand: plain rectangles, lines and text, every number formatted the
same way on every run (docs/images/draw_figures.py draws with it)."""

from __future__ import annotations

from xml.sax.saxutils import escape, quoteattr

WIDTH = 860
SANS = "Helvetica, Arial, sans-serif"
MONO = "Menlo, Consolas, monospace"
INK, GREY, LIGHT = "#222222", "#666666", "#e6e6e6"
# one color per sequence (or device), light fill and dark stroke: Okabe-Ito's blue, orange, green, purple
FILLS = ["#cfe3f5", "#fde2b8", "#cdeedd", "#ecd5e8"]
STROKES = ["#0072b2", "#c77800", "#009e73", "#9c4f96"]
HIGHLIGHT = "#d62728"


def num(value: float) -> str:
    """A coordinate: at most one decimal, no trailing zeros, so the bytes never depend on float noise."""
    return f"{value:.1f}".removesuffix(".0")


class Svg:
    """An SVG drawing built element by element; `render()` gives its text."""

    def __init__(self, height: float, title: str):
        self.height = height
        self.items = [f"<title>{escape(title)}</title>",
                      f'<rect x="0" y="0" width="{WIDTH}" height="{num(height)}" fill="#ffffff"/>']

    def rect(self, x: float, y: float, w: float, h: float, fill: str, stroke: str = GREY, width: float = 1,
             dash: bool = False, extra: str = "") -> None:
        dashed = ' stroke-dasharray="4 3"' if dash else ""
        self.items.append(f'<rect x="{num(x)}" y="{num(y)}" width="{num(w)}" height="{num(h)}" fill="{fill}" '
                          f'stroke="{stroke}" stroke-width="{num(width)}"{dashed}{extra}/>')

    def text(self, x: float, y: float, s: str, size: float = 14, anchor: str = "start", bold: bool = False,
             fill: str = INK, mono: bool = False, extra: str = "") -> None:
        weight = ' font-weight="bold"' if bold else ""
        weight += ' xml:space="preserve"' if "  " in s else ""  # keep runs of spaces
        family = MONO if mono else SANS
        self.items.append(f'<text x="{num(x)}" y="{num(y)}" font-family="{family}" font-size="{num(size)}" '
                          f'text-anchor="{anchor}" fill="{fill}"{weight}{extra}>{escape(s)}</text>')

    def line(self, x1: float, y1: float, x2: float, y2: float, stroke: str = GREY, width: float = 1.5,
             arrow: bool = False, dash: bool = False) -> None:
        head = ' marker-end="url(#arrow)"' if arrow else ""
        dashed = ' stroke-dasharray="5 4"' if dash else ""
        self.items.append(f'<line x1="{num(x1)}" y1="{num(y1)}" x2="{num(x2)}" y2="{num(y2)}" stroke="{stroke}" '
                          f'stroke-width="{num(width)}"{dashed}{head}/>')

    def curve(self, x1: float, y1: float, x2: float, y2: float, stroke: str, dash: bool = False) -> None:
        """An arrow from (x1, y1) to (x2, y2), leaving and arriving horizontally."""
        bend = (x2 - x1) / 2
        dashed = ' stroke-dasharray="5 4"' if dash else ""
        self.items.append(f'<path d="M {num(x1)} {num(y1)} C {num(x1 + bend)} {num(y1)} {num(x2 - bend)} {num(y2)} '
                          f'{num(x2)} {num(y2)}" fill="none" stroke="{stroke}" stroke-width="1.5"{dashed} '
                          f'marker-end="url(#arrow)"/>')

    def circle(self, x: float, y: float, r: float, fill: str) -> None:
        self.items.append(f'<circle cx="{num(x)}" cy="{num(y)}" r="{num(r)}" fill="{fill}"/>')

    def group(self, ident: str, data: dict[str, object] | None = None) -> None:
        attrs = "".join(f" data-{k}={quoteattr(str(v))}" for k, v in (data or {}).items())
        self.items.append(f'<g id="{ident}"{attrs}>')

    def end_group(self) -> None:
        self.items.append("</g>")

    def legend(self, x: float, y: float, entries: list[tuple[str, str, str]]) -> None:
        """One row of (fill, stroke, label) swatches from (x, y)."""
        for fill, stroke, label in entries:
            self.rect(x, y - 12, 16, 16, fill, stroke)
            self.text(x + 22, y + 1, label, size=13)
            x += 34 + 7.2 * len(label)

    def render(self) -> str:
        head = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{num(self.height)}" '
                f'viewBox="0 0 {WIDTH} {num(self.height)}">')
        marker = ('<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
                  'orient="auto-start-reverse"><path d="M 0 0 L 10 5 L 0 10 z" fill="#555555"/></marker></defs>')
        return "\n".join([head, marker, *self.items, "</svg>"]) + "\n"
