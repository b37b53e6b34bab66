"""Dead letters: ``blocks dlq`` lists them (and which were replayed), ``blocks dlq replay`` puts
them back on their original subjects (``bus.dlq``; docs/dead-letters.md)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.markup import escape

from .common import DataDir, _request, _seconds, console, err
from .render import _table

if TYPE_CHECKING:
    from ..bus.dlq import Letter, Result
    from .client import Client

app = typer.Typer(rich_markup_mode="markdown",  # (its help: dlq's docstring)
                  short_help="Every stored dead letter and whether it was replayed; `dlq replay` puts them back.")

#: replays of dead letters (``dlq.replayed``) are read until none came for this long
IDLE_S = 0.5


async def _letters(c: Client) -> tuple[list[Letter], dict[str, list[Mapping[str, Any]]]]:
    """Every stored dead letter, and the replays of each (``STREAM:SEQ`` -> their marks, oldest first)."""
    from nats.js.errors import NotFoundError

    from ..bus.catalog import E
    from ..bus.dlq import Letter, replays_by_letter

    letters = [Letter(stream, seq, stored, subject, env) for stream, seq, stored, subject, env in await c.dead_letters(IDLE_S)]
    try:
        marks = [m.data for m in await c.scan(E.dlq_replayed.filter(), IDLE_S)]
    except NotFoundError:  # a stream of a version before dlq.replayed: none replayed yet
        marks = []
    records = [d.get("data") for d in (json.loads(raw) for raw in marks)]
    return letters, replays_by_letter(r for r in records if isinstance(r, dict))


@app.callback(invoke_without_command=True)
def dlq(
    ctx: typer.Context,
    as_json: bool = typer.Option(False, "--json", help="One JSON dead letter per line."),
    data_dir: Path = DataDir,
) -> None:
    """Every stored dead letter (the admin's): the workers' from `AIOS` (`aios.dlq.>`) and the
    outputs the side-cars gave up on from `AIOS_OUTPUTS` (`aios.output.B.dlq.NAME.OUTCOME`: users'
    data, which observers cannot read; an output dead-lettered by a version before that is still
    listed from `AIOS`, `aios.dlq.sidecar-B-N.…`, until the stream's limits drop it): stream,
    sequence, when stored, consumer, the failing message's subject, deliveries, error, and whether
    it was replayed (`blocks dlq replay`: how often, the last copy's sequence). `--json` lines
    carry the whole letter (its `data` too) and its `replayed` marks.

    Example: `blocks dlq`, `blocks dlq --json`, `blocks dlq replay AIOS:42`
    """
    if ctx.invoked_subcommand is not None:
        return
    role = os.environ.get("AIOS_ROLE", "")
    if role and role != "admin":  # it reads AIOS_OUTPUTS, users' data (docs/dead-letters.md)
        err.print(f"[red]refused:[/] only the admin lists dead letters (AIOS_ROLE={escape(role)})")
        raise typer.Exit(1)

    async def go(c: Client) -> int:
        letters, replays = await _letters(c)
        if as_json:
            for lt in letters:
                print(json.dumps({"stream": lt.stream, "seq": lt.seq, "stored": lt.stored, "subject": lt.subject,
                                  "event": lt.event, "replayed": replays.get(lt.key, []),
                                  "replay_of": lt.replay_of or None}, default=str))
            return 0
        if not letters:
            console.print("no dead letters")
            return 0
        t = _table("stream", "seq", "stored", "consumer", "subject", "deliveries", "error", "replayed")
        for lt in letters:
            marks = replays.get(lt.key, [])
            done = f"{len(marks)}x, as {marks[-1].get('replay_stream')}:{marks[-1].get('replay_seq')}" if marks else ""
            if lt.replay_of:  # a replay that failed again: say which letter it came from
                done = "; ".join(x for x in (done, f"a replay of {lt.replay_of}") if x)
            t.add_row(lt.stream, str(lt.seq), lt.stored[:23], escape(lt.consumer), escape(lt.original_subject),
                      str(lt.data.get("deliveries", "")), escape(lt.error), done)
        console.print(t)
        return 0

    raise typer.Exit(_request(go, data_dir))


def _since(text: str | None) -> float | None:
    """``--since``: a duration back from now (``30m``, ``2h``, ``1d``) or an ISO 8601 time."""
    import time
    from datetime import datetime

    if not text:
        return None
    try:
        at = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        try:
            return time.time() - _seconds(text, "--since")
        except typer.BadParameter:  # the duration's message alone hid the ISO form this option takes too
            raise typer.BadParameter(f"expected a duration like 30m, 2h, 1d or an ISO time like 2026-12-01T08:00:00Z; got {text!r}",
                                     param_hint="--since") from None
    return (at if at.tzinfo else at.astimezone()).timestamp()


def _operator() -> str:
    import getpass
    import socket

    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = str(os.getuid())
    return f"{user}@{socket.gethostname()}"


def _say(r: Result, i: int, n: int, as_json: bool) -> None:
    """One line of progress: what became of the ``i``-th of ``n`` letters."""
    if as_json:
        print(json.dumps(r.as_dict()), flush=True)
        return
    lt = r.letter
    what = f"{escape(lt.original_subject)} -> {escape(lt.consumer or '?')}"
    step = f"[{i}/{n}] " if n > 1 else ""
    if r.outcome == "replayed":
        again = " (stored before: this attempt's copy was already there)" if r.duplicate else ""
        console.print(f"{step}[green]replayed[/] {lt.key} ({what}) as {r.stream}:{r.seq}{again}"
                      + (f", attempt {r.attempt}" if r.attempt > 1 else "") + ("" if r.source == "stream" else ", from the letter's copy"))
    elif r.outcome == "dry-run":
        console.print(f"{step}would replay {lt.key} ({what}) to {r.stream}, the original from the "
                      f"{'stream' if r.source == 'stream' else 'letter'}" + (f", attempt {r.attempt}" if r.attempt > 1 else ""))
    else:
        err.print(f"{step}[red]{r.outcome}[/] {lt.key} ({what}): {escape(r.reason)}")


def replay(
    ids: list[str] = typer.Argument(None, metavar="ID", show_default=False,
                                    help="Dead letters by `SEQ` (`blocks dlq`'s), `STREAM:SEQ` (`AIOS:42`, "
                                         "`AIOS_OUTPUTS:7`) or the letter's event id (`dlq:gateway:1234`)."),
    subject: str = typer.Option("", "--subject", help="Only letters whose original subject contains this."),
    consumer: str = typer.Option("", "--consumer", help="Only letters of consumers (durables) whose name contains this."),
    reason: str = typer.Option("", "--reason", help="Only letters whose error contains this (any case)."),
    since: str = typer.Option(None, "--since", help="Only letters stored since then: a duration back (`30m`, `2h`, "
                                                     "`1d`) or an ISO 8601 time."),
    everything: bool = typer.Option(False, "--all", help="Every dead letter (needed when neither ids nor a filter say which)."),
    force: bool = typer.Option(False, "--force", help="Replay letters that were replayed before too, and those whose "
                                                      "consumer is gone or no longer takes their subject."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Say what would be replayed (and what refused); send nothing."),
    as_json: bool = typer.Option(False, "--json", help="One JSON line per letter: letter, outcome, reason, replay."),
    data_dir: Path = DataDir,
) -> None:
    """Put dead letters back: each letter's original message (its subject, body and headers; the
    original as the stream still holds it, else the letter's copy when it is whole) is published
    again, so the consumer that gave up on it takes it again, once you fixed the cause (a
    policy, a node, a full disk). The body, and so the event's id, is unchanged: the handlers are
    idempotent by it, and every other consumer of the subject takes the copy as a redelivery. The
    copy has a message id of its own (the original's would be dropped as a duplicate) and an
    `Aios-Replay-Of: STREAM:SEQ` header; each replayed letter is marked (`dlq.replayed`: by
    whom, when, the copy's sequence), `blocks dlq` shows it, and replaying it again is refused
    without `--force`. A letter whose subject this version no longer has, whose consumer is gone,
    or whose original the stream dropped while the letter kept only part of it, is refused.
    Letters go 256 at a time (their copies published together, in order, then their marks), one
    line each. A replayed block create is that create again, at its own gen: it makes its block
    once, or does nothing where it made it already.
    Admin only (the CLI's own user). Exit 0: all replayed; 1: any refused, failed, unmarked or
    not found; 2: usage.

    Example: `blocks dlq replay 42`, `blocks dlq replay AIOS:42 AIOS_OUTPUTS:7`, `blocks dlq replay
    --consumer gateway --since 1h --dry-run`, `blocks dlq replay --all`
    """
    from ..bus.dlq import Filter

    ids = ids or []
    flt = Filter(subject, consumer, reason, _since(since))
    if not ids and not flt.given() and not everything:
        err.print("[red]error:[/] say which dead letters: ids (SEQ, STREAM:SEQ or the letter's event id), a filter "
                  "(--subject, --consumer, --reason, --since), or --all for every one (see `blocks dlq replay --help`)")
        raise typer.Exit(2)
    role = os.environ.get("AIOS_ROLE", "")
    if role and role != "admin":
        err.print(f"[red]refused:[/] only the admin replays dead letters (AIOS_ROLE={escape(role)})")
        raise typer.Exit(1)
    raise typer.Exit(_request(lambda c: _replay(c, ids, flt, everything, force, dry_run, as_json), data_dir))


def _say_selection(sel: Any, named: bool, as_json: bool) -> None:
    """The ids that named no letter and the letters replayed before (not --force), before any is
    sent: refused when ``named`` by id, else skipped (a filter or --all took them)."""
    from ..bus import dlq as dl

    for ref, why in sel.missing:
        if as_json:
            print(json.dumps({"letter": ref, "outcome": "not found", "reason": why}))
        else:
            err.print(f"[red]{escape(why)}[/]")
    for lt, why in sel.refused:
        if named or as_json:
            _say(dl.Result(lt, "refused" if named else "skipped", why), 0, 1, as_json)
        else:
            console.print(f"[yellow]skipped[/] {lt.key} ({escape(lt.original_subject)} -> {escape(lt.consumer)}): {escape(why)}")


async def _replay(c: Client, ids: list[str], flt: Any, everything: bool, force: bool, dry_run: bool, as_json: bool) -> int:
    from ..bus import dlq as dl

    letters, replays = await _letters(c)
    sel = dl.select(letters, ids, flt, everything, replays, force)
    _say_selection(sel, bool(ids), as_json)
    # a letter named by its id and refused, or an id naming none, fails the command; one a filter skipped does not
    failed = bool(sel.missing) or bool(sel.refused and ids)
    if not sel.chosen:
        if not failed and not as_json:
            console.print(f"nothing to replay: {len(sel.refused)} replayed before (--force replays them again)"
                          if sel.refused else "no dead letter matches: nothing to replay")
        return 1 if failed else 0
    n, counts = len(sel.chosen), {"replayed": 0, "dry-run": 0, "refused": 0, "failed": 0, "unmarked": 0}
    todo = [(lt, len(replays.get(lt.key, [])) + 1) for lt in sel.chosen]
    i = 0
    async for r in dl.replay_many(c.bus, todo, _operator(), force=force, dry_run=dry_run):  # a window at a time
        i += 1
        counts[r.outcome] += 1
        _say(r, i, n, as_json)
    if not as_json and (n > 1 or sel.refused):
        _summary(counts, len(sel.refused), dry_run)
    return 1 if failed or counts["refused"] or counts["failed"] or counts["unmarked"] else 0


def _summary(counts: dict[str, int], skipped: int, dry_run: bool) -> None:
    """The last line of a replay of several letters: how many of each outcome."""
    done = f"{counts['dry-run']} would be replayed" if dry_run else f"{counts['replayed']} replayed"
    bad = "".join(f", {counts[k]} {k}" for k in ("failed", "unmarked") if counts[k])
    console.print(f"{done}, {counts['refused']} refused{bad}" + (f", {skipped} skipped: replayed before (--force)" if skipped else ""))


app.command("replay", short_help="Put dead letters back on their original subjects, once their cause is fixed.")(replay)
