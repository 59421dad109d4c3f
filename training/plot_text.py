"""Text from data is drawn as it is in hsx's plots (`hsx report`'s figures, `hsx eval-drafter --out`'s
acceptance_per_position.png). Matplotlib reads `$...$` as math: a corpus file named `price$_$list.jsonl` or a drafter
folder `x$_$` fails the whole figure (ParseFatalException), and `$a$` loses its dollars; a user's matplotlibrc may
turn on TeX (text.usetex), where `_`, `%` and `&` fail too; a legend leaves out every label starting with "_".

    literal_text() -> context manager    every Text made or drawn inside it: no mathtext, no TeX (the figure is
                                          built and saved inside it)
    png(fig, **savefig) -> bytes          the figure as PNG, every Text already on it made literal first, drawn
                                          inside literal_text()
    legend_label(text) -> str             a label a legend shows even when it starts with "_" (a zero-width space
                                          before it)
    figure(width, height, **kw) -> Figure a figure on Agg's canvas (no pyplot: no global state, nothing to close)

Both plotting modules use these; it sits on training/, the lowest floor both import (jobs/report.py is above it).
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterator

ZERO_WIDTH_SPACE = "\u200b"
_LITERAL_RC = {"text.parse_math": False, "text.usetex": False}


@contextlib.contextmanager
def literal_text() -> Iterator[None]:
    """matplotlib's rc for every Text created inside: no mathtext (`$` is a dollar), no TeX."""
    import matplotlib

    with matplotlib.rc_context(_LITERAL_RC):
        yield


def legend_label(text: object) -> str:
    """`text` as a legend label that is shown: matplotlib's legend skips labels starting with "_"."""
    text = str(text)
    return ZERO_WIDTH_SPACE + text if text.startswith("_") else text


def figure(width: float, height: float, **kw):
    """A matplotlib Figure of `width` x `height` inches on Agg's canvas (`kw`: Figure's, e.g. layout)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), **kw)
    FigureCanvasAgg(fig)
    return fig


def png(fig, **savefig) -> bytes:
    """`fig` drawn as PNG with every Text on it literal (those made outside literal_text() too)."""
    from matplotlib.text import Text

    with literal_text():
        for t in fig.findobj(Text):
            t.set_usetex(False)
            t.set_parse_math(False)
        buf = io.BytesIO()
        fig.savefig(buf, format="png", **savefig)
    return buf.getvalue()
