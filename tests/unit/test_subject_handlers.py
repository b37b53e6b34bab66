"""One jump from a subject to its handler (issue 35): every route of every durable consumer names
a module-level function (no closure inside ``bindings``), reachable by its ``module:qualname``, and
docs/subjects.md's handlers table is the one the bindings give."""

from __future__ import annotations

import importlib
from pathlib import Path

from aios_blocks.runtime import routes
from aios_blocks.workers import gateway, parser, vcluster


def _resolve(name: str) -> object:
    module, qualname = name.split(":")
    obj: object = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def test_every_route_names_a_module_level_function() -> None:
    rows = routes.rows()
    durables = {d for d, _, _ in rows}
    assert {"parser", "gateway", "controller", "lifecycle", "vcluster", "mapper", "agent-sim"} <= durables
    for durable, subject, name in rows:
        assert "<locals>" not in name, f"{durable} {subject}: {name} is a closure; make it a module-level on_*(w, m)"
        assert callable(_resolve(name)), name


def test_the_workers_own_handlers_are_theirs() -> None:
    by_subject = {(d, s): n for d, s, n in routes.rows()}
    assert by_subject["parser", "aios.block.{bid}.create"] == "aios_blocks.workers.parser:on_create"
    assert by_subject["gateway", "aios.block.{bid}.dry_run.result"] == "aios_blocks.workers.gateway:on_result"
    assert by_subject["vcluster", "aios.block.{bid}.failed"] == "aios_blocks.workers.vcluster:on_block_end"
    assert _resolve("aios_blocks.workers.parser:on_create") is parser.on_create
    assert _resolve("aios_blocks.workers.gateway:on_parsed") is gateway.on_parsed
    assert _resolve("aios_blocks.workers.vcluster:on_remove") is vcluster.on_remove


def test_docs_subjects_handlers_table_is_current() -> None:
    doc = Path(__file__).resolve().parents[2] / "docs" / "subjects.md"
    text = doc.read_text()
    assert routes.render_into(text) == text, "docs/subjects.md is stale: paste `blocks subjects --handlers --markdown` between the handlers markers"
