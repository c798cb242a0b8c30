"""The demos' live view: rich's Live, ended on a line of its own.

On a terminal Live redraws in place. Into a pipe or a file it writes its last frame as it
stops, and leaves that frame's bottom border without a newline, so whatever is printed next
(the summary) ran into it: the view ends that line itself there.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from rich.live import Live

WINDOW_S = 10.0
"""The live views' TTFT and rates cover the last this-many seconds (the summaries: the run)."""


@contextmanager
def live_view() -> Iterator[Live]:
    with Live(refresh_per_second=4) as live:
        yield live
    if not live.console.is_terminal:
        live.console.line()
