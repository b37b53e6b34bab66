"""docs/subjects.md's table, derived from the event catalog (``bus.catalog``) and the durable
consumers' filters, so the doc cannot drift from the code
(``blocks subjects --markdown`` prints it; a unit test keeps the file equal to it)."""

from __future__ import annotations

import re

from . import subjects
from .catalog import EVENTS, E

E_OUTPUT_ALL = E.block_output.filter()

_TOKEN = re.compile(r"\{[a-z_]+\}")

#: the durable consumers, by name as the docs show them
DURABLES: tuple[subjects.ConsumerSpec, ...] = (
    subjects.PARSER,
    subjects.GATEWAY,
    subjects.controller(),
    subjects.LIFECYCLE,
    subjects.VCLUSTER,
    subjects.agent(),
    # every side-car's own durable on AIOS_OUTPUTS (docs/sidecars.md)
    subjects.ConsumerSpec("sidecar-{bid}-{name}", (E_OUTPUT_ALL,), stream=subjects.STREAM_OUTPUTS),
)


def sample(pattern: str) -> str:
    """A concrete subject of ``pattern``: each ``{token}`` becomes a one-token id."""
    return _TOKEN.sub("x", pattern)


def stored(pattern: str) -> bool:
    """Whether a stream keeps messages on ``pattern``."""
    return any(subjects.matches(f, sample(pattern)) for f in (*subjects.STREAM_SUBJECTS, *subjects.OUTPUT_STREAM_SUBJECTS,
                                                                *subjects.INTAKE_STREAM_SUBJECTS))


def consumers(pattern: str) -> list[str]:
    """Durable consumers whose filters take ``pattern`` (``agent-sim`` stands for every agent's own);
    a query (not stored) names the consumer whose queue group takes it."""
    s = sample(pattern)
    return [c.durable for c in DURABLES if any(subjects.matches(f, s) for f in c.filters)] + [
        f"{c.durable} (queue group)" for c in DURABLES if any(subjects.matches(f, s) for f in c.core_filters)]


def catalog_rows() -> list[tuple[str, str, str, str, str, str]]:
    """(subject, published by, stored, durable consumers, message id, meaning) per catalog event."""
    rows = []
    for (pattern, publisher, meaning), e in zip(subjects.catalog(), EVENTS, strict=True):
        mid = f"`{e.id_rule}`" if e.id_rule else ("-" if not e.stored else "chosen by the publisher")
        where = ("yes" if e.stream == subjects.STREAM else f"yes ({e.stream})") if e.stored else "no"
        rows.append((pattern, publisher, where, ", ".join(consumers(pattern)) or "-", mid, meaning))
    return rows


def catalog_markdown() -> str:
    """The table of docs/subjects.md."""
    lines = [
        "| subject | published by | stored | durable consumers | message id | meaning |",
        "|---|---|---|---|---|---|",
    ]
    for subject, publisher, kept, durable, mid, meaning in catalog_rows():
        cells = [f"`{subject}`", publisher, kept, durable, mid, meaning]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)


BEGIN, END = "<!-- catalog:begin -->", "<!-- catalog:end -->"


def render_into(text: str) -> str:
    """``text`` (docs/subjects.md) with the table between the markers replaced by the catalog's."""
    start, stop = text.index(BEGIN), text.index(END)
    return text[: start + len(BEGIN)] + "\n" + catalog_markdown() + "\n" + text[stop:]
