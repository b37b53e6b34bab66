"""docs/subjects.md's table, derived from the subject catalog (``subjects.catalog()``), the
stream's subjects and the durable consumers' filters, so the doc cannot drift from the code
(``blocks subjects --markdown`` prints it; a unit test keeps the file equal to it)."""

from __future__ import annotations

import re

from . import subjects

_TOKEN = re.compile(r"\{[a-z_]+\}")

#: the durable consumers, by name as the docs show them
DURABLES: tuple[subjects.ConsumerSpec, ...] = (
    subjects.PARSER,
    subjects.GATEWAY,
    subjects.controller(),
    subjects.LIFECYCLE,
    subjects.agent(),
)


def sample(pattern: str) -> str:
    """A concrete subject of ``pattern``: each ``{token}`` becomes a one-token id."""
    return _TOKEN.sub("x", pattern)


def stored(pattern: str) -> bool:
    """Whether the stream keeps messages on ``pattern``."""
    return any(subjects.matches(f, sample(pattern)) for f in subjects.STREAM_SUBJECTS)


def consumers(pattern: str) -> list[str]:
    """Durable consumers whose filters take ``pattern`` (``agent-sim`` stands for every agent's own)."""
    s = sample(pattern)
    return [c.durable for c in DURABLES if any(subjects.matches(f, s) for f in c.filters)]


def catalog_rows() -> list[tuple[str, str, str, str, str]]:
    """(subject, published by, stored, durable consumers, meaning) per catalog entry."""
    return [
        (pattern, publisher, "yes" if stored(pattern) else "no", ", ".join(consumers(pattern)) or "-", meaning)
        for pattern, publisher, meaning in subjects.catalog()
    ]


def catalog_markdown() -> str:
    """The table of docs/subjects.md."""
    lines = [
        "| subject | published by | stored | durable consumers | meaning |",
        "|---|---|---|---|---|",
    ]
    for subject, publisher, kept, durable, meaning in catalog_rows():
        cells = [f"`{subject}`", publisher, kept, durable, meaning]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)


BEGIN, END = "<!-- catalog:begin -->", "<!-- catalog:end -->"


def render_into(text: str) -> str:
    """``text`` (docs/subjects.md) with the table between the markers replaced by the catalog's."""
    start, stop = text.index(BEGIN), text.index(END)
    return text[: start + len(BEGIN)] + "\n" + catalog_markdown() + "\n" + text[stop:]
