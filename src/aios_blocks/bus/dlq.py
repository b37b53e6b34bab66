"""Dead letters put back (``blocks dlq replay``; docs/dead-letters.md), as a redrive
(SQS) or a shovel back to the queue (RabbitMQ) does it: the original message, on its original
subject, so the consumer that gave up on it takes it again once its cause is fixed.

What a replay sends and why:

* **the bytes**: the original message as its stream still holds it (at the letter's
  ``stream_seq``, the same subject); else the copy the letter kept, unless that copy was cut
  (a worker's letter keeps 64 Ki characters, a side-car's 8 KiB) or is not the text it was
  (bytes that were not UTF-8): then it is refused, not sent half;
* **the headers**: the original's, less the ``Nats-*`` ones (JetStream's own: id, expectations,
  batches), plus ``Aios-Replay-Of: STREAM:SEQ`` (the letter) and a ``Nats-Msg-Id`` of its own;
* **the ids**: the body, and so the CloudEvent ``id``, is unchanged: the handlers are idempotent by
  it (each step they take is a compare-and-set whose events carry ids derived from it, deduplicated
  by JetStream), so whatever the failing attempts did store is not done twice, and every other
  consumer of that subject, which handled it already, takes the copy as the redelivery at-least-once
  means. The wire ``Nats-Msg-Id`` is new (the keyed digest of ``replay:STREAM:SEQ:ATTEMPT``): the
  original's would make the stream drop the copy as a duplicate within its window. It is the same
  for the same attempt, so a command cut between its publish and its mark, run again, stores no
  second copy (within the duplicate window);
* **the mark**: ``dlq.replayed`` (catalog, published by the admin only), after the copy is stored:
  ``blocks dlq`` shows the letter as replayed, and another replay of it is refused unless
  ``--force`` (attempt 2 and up).

Selection, the ids and the message made are plain functions here (tests/unit/test_dlq_replay.py);
``replay_many`` publishes: a window of letters at a time, their originals read together
(``stored_many``: their ``STREAM.MSG.GET`` requests sent at once), their copies' acks awaited
together, then their marks' (one letter at a time, a publish and a mark each awaited, made 86
letters/s).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from ..schemas.dlq import DlqReplayed
from . import subjects
from .catalog import E, parse, stream_of

#: the header a replayed copy carries: the letter it came from (``STREAM:SEQ``)
REPLAY_OF = "Aios-Replay-Of"
#: and the sequence of the message it is a copy of, in its stream (``replay_headers``)
REPLAY_SEQ = "Aios-Replay-Seq"
_REF = re.compile(r"^(?:(?P<stream>[A-Z][A-Z0-9_]*):)?(?P<seq>[0-9]+)$")


class Refused(Exception):
    """This letter is not replayed: the reason, for the operator."""


@dataclass(frozen=True)
class Letter:
    """One stored dead letter: where it is (``stream``, ``seq``), when it was stored and what it says."""

    stream: str
    seq: int
    stored: str
    subject: str
    event: Mapping[str, Any]

    @property
    def key(self) -> str:
        return f"{self.stream}:{self.seq}"

    @property
    def data(self) -> Mapping[str, Any]:
        d = self.event.get("data")
        return d if isinstance(d, dict) else {}

    @property
    def id(self) -> str:
        return str(self.event.get("id") or "")

    @property
    def original_subject(self) -> str:
        return str(self.data.get("subject") or "")

    @property
    def consumer(self) -> str:
        return str(self.data.get("consumer") or "")

    @property
    def error(self) -> str:
        return str(self.data.get("error") or "")

    @property
    def original_seq(self) -> int:
        return int(self.data.get("stream_seq") or 0)

    @property
    def replay_of(self) -> str:
        """The letter (``STREAM:SEQ``) whose replay failed again into this one, or ""."""
        h = self.data.get("headers")
        return str(h.get(REPLAY_OF) or "") if isinstance(h, dict) else ""

    @property
    def sidecar(self) -> bool:
        """An output a side-car gave up on (``output.dlq``, or ``aios.dlq.sidecar-…`` of an older version)."""
        return self.subject.startswith(E.output_dead_letter.filter().split("*", 1)[0]) or self.consumer.startswith("sidecar-")


@dataclass(frozen=True)
class Filter:
    """What ``--subject``, ``--consumer``, ``--reason`` (substrings) and ``--since`` (epoch seconds) keep."""

    subject: str = ""
    consumer: str = ""
    reason: str = ""
    since: float | None = None

    def given(self) -> bool:
        return bool(self.subject or self.consumer or self.reason) or self.since is not None

    def keeps(self, letter: Letter) -> bool:
        if self.subject and self.subject not in letter.original_subject:
            return False
        if self.consumer and self.consumer not in letter.consumer:
            return False
        if self.reason and self.reason.lower() not in letter.error.lower():
            return False
        return self.since is None or stored_epoch(letter.stored) >= self.since


@dataclass
class Selection:
    """Letters to replay, in the order given (ids) or stored (filters); ``missing``: ids that name
    none (or more than one); ``refused``: letters replayed before, without ``--force``."""

    chosen: list[Letter] = field(default_factory=list)
    missing: list[tuple[str, str]] = field(default_factory=list)
    refused: list[tuple[Letter, str]] = field(default_factory=list)


def stored_epoch(iso: str) -> float:
    """``2026-11-30T16:20:00.123Z`` -> epoch seconds (0 for what is not a time)."""
    try:
        return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return 0.0


def replays_by_letter(records: Iterable[Mapping[str, Any]]) -> dict[str, list[Mapping[str, Any]]]:
    """``dlq.replayed`` events' payloads by the letter they replayed (``STREAM:SEQ``), oldest first."""
    out: dict[str, list[Mapping[str, Any]]] = {}
    for r in records:
        if r.get("stream") and r.get("seq") is not None:
            out.setdefault(f"{r['stream']}:{r['seq']}", []).append(r)
    return out


def _find(letters: list[Letter], ref: str) -> list[Letter]:
    m = _REF.match(ref.strip())
    if m is None:  # the letter's event id (``dlq:CONSUMER:SEQ``)
        return [lt for lt in letters if lt.id == ref]
    seq, stream = int(m["seq"]), m["stream"]
    return [lt for lt in letters if lt.seq == seq and (stream is None or lt.stream == stream)]


def already(history: list[Mapping[str, Any]]) -> str:
    """How a letter's last replay reads: ``replayed by X at T as AIOS:N (attempt K)``."""
    last = history[-1]
    at = datetime.fromtimestamp(float(last.get("at") or 0)).astimezone().isoformat(timespec="seconds")
    return (f"replayed by {last.get('by', '?')} at {at} as {last.get('replay_stream', '?')}:{last.get('replay_seq', '?')}"
            f" (attempt {last.get('attempt', 1)})")


def select(letters: list[Letter], refs: list[str], flt: Filter, everything: bool,
           replays: Mapping[str, list[Mapping[str, Any]]], force: bool = False) -> Selection:
    """Which letters a replay takes. ``refs`` (``SEQ``, ``STREAM:SEQ`` or the letter's event id)
    take those letters, each once, the filter narrowing them; else the filter's letters; else,
    with ``everything``, all of them. A letter replayed before is refused unless ``force``. Raises
    ValueError when nothing selects (neither ids, a filter nor ``everything``)."""
    if not refs and not flt.given() and not everything:
        raise ValueError("say which dead letters: their ids (SEQ, STREAM:SEQ or the letter's event id), a filter "
                         "(--subject, --consumer, --reason, --since), or --all for every one")
    sel = Selection()
    picked: list[Letter] = []
    if refs:
        for ref in refs:
            found = _find(letters, ref)
            if not found:
                sel.missing.append((ref, f"no dead letter {ref} (blocks dlq lists them)"))
            elif len(found) > 1:
                where = " or ".join(lt.key for lt in found)
                sel.missing.append((ref, f"{ref} names more than one dead letter: say which, {where}"))
            elif found[0] not in picked:
                picked.append(found[0])
    else:
        picked = list(letters)
    for lt in picked:
        if not flt.keeps(lt):
            continue
        history = replays.get(lt.key, [])
        if history and not force:
            sel.refused.append((lt, f"already {already(history)}; --force replays it again"))
        else:
            sel.chosen.append(lt)
    return sel


def target(letter: Letter) -> tuple[str, str]:
    """(the stream that stores the original subject now, the subject); Refused when this version's
    catalog has no stored event of that subject (renamed or gone, or never stored)."""
    subject = letter.original_subject
    if not subject:
        raise Refused("the letter names no original subject")
    found = parse(subject)
    if found is None:
        raise Refused(f"its subject {subject} is no event of this version's catalog (renamed or removed: "
                      "blocks subjects lists them); not replayed")
    stream = stream_of(found[0])
    if stream is None:
        raise Refused(f"its subject {subject} ({found[0].name}) is core NATS, stored by no stream; not replayed")
    return stream, subject


def replay_msg_id(letter: Letter, attempt: int) -> str:
    """The copy's logical message id (the wire one is its keyed digest): one per letter and attempt."""
    return f"replay:{letter.key}:{attempt}"


def letter_body(letter: Letter) -> bytes:
    """The body the letter kept, when it is the whole original (else Refused)."""
    from ..sidecar import DLQ_DATA_BYTES
    from .runner import DLQ_DATA_CHARS

    text = str(letter.data.get("data") or "")
    cut = len(text.encode()) >= DLQ_DATA_BYTES if letter.sidecar else len(text) >= DLQ_DATA_CHARS
    if cut:
        raise Refused("its original is no longer in the stream (its limits dropped it) and the letter kept only "
                      "the first part of it; not replayed")
    if "\ufffd" in text:
        raise Refused("its original is no longer in the stream and the letter's copy is not its bytes (they were "
                      "not UTF-8); not replayed")
    return text.encode()


def replay_headers(original: Mapping[str, str], letter: Letter, msg_id: str) -> dict[str, str]:
    """The original's headers less JetStream's own (``Nats-*``), with the copy's id and where it came
    from: the letter (``Aios-Replay-Of``) and the first original's sequence in its stream
    (``Aios-Replay-Seq``: the letter's ``stream_seq``, or, when that message was itself a copy,
    the one it carried), by which a consumer may take the copy as that message again (the parser:
    a create at its own gen, docs/dead-letters.md)."""
    copy = REPLAY_OF in original and str(original.get(REPLAY_SEQ, "")).isdigit()
    out = {k: str(v) for k, v in original.items() if not k.lower().startswith("nats-") and k not in (REPLAY_OF, REPLAY_SEQ)}
    out.setdefault("Content-Type", "application/json")
    out["Nats-Msg-Id"] = msg_id
    out[REPLAY_OF] = letter.key
    first = str(original[REPLAY_SEQ]) if copy else str(letter.original_seq or "")
    if first and first != "0":
        out[REPLAY_SEQ] = first
    return out


@dataclass
class Result:
    """What became of one letter: ``replayed`` (``seq``: where the copy is), ``dry-run``, ``refused``,
    ``skipped`` (replayed before, taken by a filter or --all), ``failed`` (its copy's publish not
    acked: maybe stored), ``unmarked`` (sent, its mark not stored)."""

    letter: Letter
    outcome: str
    reason: str = ""
    stream: str = ""
    seq: int = 0
    source: str = ""
    attempt: int = 1
    duplicate: bool = False

    def as_dict(self) -> dict[str, Any]:
        lt = self.letter
        return {"letter": lt.key, "id": lt.id, "subject": lt.original_subject, "consumer": lt.consumer,
                "outcome": self.outcome, "reason": self.reason, "attempt": self.attempt,
                "replay": f"{self.stream}:{self.seq}" if self.seq else "", "source": self.source}


async def stored_at(bus: Any, stream: str, seq: int, subject: str) -> tuple[bytes, dict[str, str]] | None:
    """The message ``stream`` holds at ``seq`` when it is on ``subject`` (None: gone, or something
    else at that sequence)."""
    from nats.js.errors import NotFoundError

    if seq <= 0:
        return None
    try:
        msg = await bus.js.get_msg(stream, seq)
    except NotFoundError:
        return None
    if msg.subject != subject:
        return None
    return bytes(msg.data or b""), dict(msg.headers or {})


#: how long ``stored_many`` waits for the answers to its reads (as long as one JetStream request)
READ_TIMEOUT_S = 10.0

Held = tuple[bytes, dict[str, str]] | None | Exception


async def stored_many(bus: Any, wanted: list[tuple[str, int, str]], timeout: float = READ_TIMEOUT_S) -> list[Held]:
    """``stored_at`` of each (stream, seq, subject), in that order: the message, None (gone, or
    another subject at that sequence; nothing asked for a seq of 0), or the error that kept it
    from being read (NATS gone, no answer in ``timeout``). The same ``STREAM.MSG.GET`` requests
    as ``stored_at``'s (no other right), all sent at once to one reply subscription of this
    call, their answers awaited together: a window's reads cost one round trip, not one
    request's overhead each (nats-py's request and its answer's parsing were 0.3 ms a letter)."""
    from nats.errors import TimeoutError as NatsTimeout

    out: list[Held] = [None] * len(wanted)
    left = {i for i, (_, seq, _) in enumerate(wanted) if seq > 0}
    if not left:
        return out
    nc, prefix = bus.nc, getattr(bus.js, "_prefix", "$JS.API")
    inbox = nc.new_inbox()
    all_in = asyncio.get_running_loop().create_future()

    async def answer(msg: Any) -> None:
        i = int(msg.subject.rsplit(".", 1)[-1])
        if i in left:
            try:
                out[i] = _held(msg, wanted[i][2])
            except Exception as exc:  # an answer that is not one (its letter failed with why)
                out[i] = exc
            left.discard(i)
            if not left and not all_in.done():
                all_in.set_result(None)

    sub = None
    try:
        sub = await nc.subscribe(f"{inbox}.*", cb=answer)
        for i in sorted(left):
            stream, seq, _ = wanted[i]
            await nc.publish(f"{prefix}.STREAM.MSG.GET.{stream}", b'{"seq":%d}' % seq, reply=f"{inbox}.{i}")
        await asyncio.wait_for(asyncio.shield(all_in), timeout)
    except Exception as exc:  # the connection gone (each letter not read has this error), or no answer in time
        why = NatsTimeout() if isinstance(exc, TimeoutError) else exc
        for i in left:
            out[i] = why
    finally:
        if sub is not None:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
    return out


def _held(msg: Any, subject: str) -> Held:
    """One ``STREAM.MSG.GET`` answer as ``stored_at`` takes it (nats-py's ``get_msg``: the same
    errors, the headers parsed alike)."""
    import base64

    import msgspec
    from nats.js.errors import APIError, NotFoundError, ServiceUnavailableError

    if not msg.data and (msg.headers or {}).get("Status") == "503":  # no responders: JetStream is not there
        return ServiceUnavailableError()
    try:
        resp = msgspec.json.decode(msg.data)
        if "error" in resp:
            APIError.from_error(resp["error"])  # (it raises the error's own class)
        m = resp["message"]
    except NotFoundError:
        return None
    except Exception as exc:
        return exc
    if m.get("subject") != subject:
        return None
    headers = header_lines(base64.b64decode(m["hdrs"])[10:]) if m.get("hdrs") else {}  # (after ``NATS/1.0\r\n``)
    return (base64.b64decode(m["data"]) if m.get("data") else b""), headers


#: a header line as it is most often: a name (printable ASCII but ``:``), ``:``, printable ASCII or tabs
_HEADER_LINE = re.compile(r"[\x21-\x39\x3b-\x7e]+:[\t\x20-\x7e]*")


def header_lines(raw: bytes) -> dict[str, str]:
    """A stored message's header lines (``Key: value\\r\\n`` each, then an empty line) as nats-py's
    ``get_msg`` gives them, the email parser's headers: a value without its leading blanks; of
    a key given twice, the last. Lines that are all plainly ``Key: value`` are split here (the
    parser took 50 µs a message, half the time of a window's reads); anything else (a continued
    line, other bytes, a body after them) goes to that parser."""
    text = raw.decode("latin-1")
    lines = text[:-4].split("\r\n") if text.endswith("\r\n\r\n") else None
    if lines is not None and all(_HEADER_LINE.fullmatch(line) for line in lines):
        return {key: value.lstrip(" \t") for key, _, value in (line.partition(":") for line in lines)}
    from email.parser import BytesParser

    return dict(BytesParser().parsebytes(raw).items())


async def _check_consumer(bus: Any, stream: str, letter: Letter,
                          consumers: dict[tuple[str, str], asyncio.Future[Any]] | None = None) -> None:
    """The consumer that gave up still exists and still takes the subject (else nobody it was meant
    for handles the copy). ``consumers``: each one's info, looked up once for every letter of it."""
    from nats.js.errors import NotFoundError

    key = (stream, letter.consumer)
    cache = consumers if consumers is not None else {}
    if key not in cache:
        cache[key] = asyncio.ensure_future(bus.js.consumer_info(stream, letter.consumer))
    try:
        info = await asyncio.shield(cache[key])
    except NotFoundError:
        raise Refused(f"its consumer {letter.consumer} is no longer on {stream} (its block, node or cluster is gone?): "
                      "nobody it was meant for would take it; --force sends it anyway") from None
    cfg = info.config
    filters = [f for f in (cfg.filter_subjects or [cfg.filter_subject]) if f]
    if filters and not any(subjects.matches(f, letter.original_subject) for f in filters):
        raise Refused(f"its consumer {letter.consumer} no longer takes {letter.original_subject} (it takes "
                      f"{', '.join(filters)}); --force sends it anyway")


Prepared = tuple[str, bytes, dict[str, str], str]


async def prepare(bus: Any, letters: list[Letter], force: bool,
                  consumers: dict[tuple[str, str], asyncio.Future[Any]] | None = None) -> list[Prepared | Exception]:
    """Each letter's copy, (stream, body, original headers, source), or why not: Refused, or the
    error that kept it from reading the consumer or the original (NATS gone: that letter
    ``failed``, nothing sent). The consumers are checked first (each looked up once for all
    its letters), then the originals of the letters that passed are read together
    (``stored_many``): a letter refused reads nothing, as one at a time."""
    cache = consumers if consumers is not None else {}

    async def checked(letter: Letter) -> str | Exception:
        try:
            stream, _ = target(letter)
            if not force and letter.consumer:
                await _check_consumer(bus, stream, letter, cache)
            return stream
        except Exception as exc:
            return exc

    streams = await asyncio.gather(*(checked(lt) for lt in letters))
    held = await stored_many(bus, [(st, lt.original_seq, lt.original_subject) if isinstance(st, str) else ("", 0, "")
                                   for lt, st in zip(letters, streams, strict=True)])
    out: list[Prepared | Exception] = []
    for lt, stream, original in zip(letters, streams, held, strict=True):
        if isinstance(stream, Exception):
            out.append(stream)
        elif isinstance(original, Exception):
            out.append(original)
        elif original is not None:
            out.append((stream, original[0], original[1], "stream"))
        else:
            headers = lt.data.get("headers")
            try:
                out.append((stream, letter_body(lt), dict(headers) if isinstance(headers, dict) else {}, "letter"))
            except Refused as exc:
                out.append(exc)
    return out


#: letters a replay has in flight at once: their originals read together (``stored_many``), then their copies
#: published with their acks awaited together, then their marks likewise (``replay_many``)
WINDOW = 256
#: how long a window's publishes wait for their acks
ACK_TIMEOUT_S = 10.0


async def replay_many(bus: Any, letters: list[tuple[Letter, int]], by: str, force: bool = False, dry_run: bool = False,
                      window: int = WINDOW) -> AsyncIterator[Result]:
    """Replay each (letter, attempt), ``window`` at a time: each window's consumers are checked,
    then its originals read together (``prepare``); its copies are published in the order given,
    on one connection, so the streams store them in that order, their acks awaited together;
    then the marks of those stored, likewise. Yields each letter's :class:`Result` in the order
    given, a window at a time (the caller's progress). What a letter's copy or mark could not do
    is its own result (``refused``, ``failed``, ``unmarked``): the others go on."""
    consumers: dict[tuple[str, str], asyncio.Future[Any]] = {}
    for lo in range(0, len(letters), max(1, window)):
        for r in await _window(bus, letters[lo:lo + window], by, force, dry_run, consumers):
            yield r


async def _send(bus: Any, subject: str, body: bytes, headers: dict[str, str]) -> asyncio.Future[Any]:
    """``publish_async``'s future of the ack; one failed with the error when the publish itself
    raised (the connection gone): that letter's result, not the command's end."""
    try:
        fut: asyncio.Future[Any] = await bus.js.publish_async(subject, body, headers=headers)
    except Exception as exc:
        fut = asyncio.get_running_loop().create_future()
        fut.set_exception(exc)
    return fut


async def _acks(futs: list[Any]) -> list[tuple[Any, BaseException | None]]:
    """Each publish's (ack, None) or (None, why not), the acks awaited together."""
    if not futs:
        return []
    _, late = await asyncio.wait(futs, timeout=ACK_TIMEOUT_S)
    out: list[tuple[Any, BaseException | None]] = []
    for f in futs:
        if f in late:
            f.cancel()
            out.append((None, TimeoutError(f"no ack from the stream in {ACK_TIMEOUT_S:.0f} s")))
        else:
            out.append((None, f.exception()) if f.exception() is not None else (f.result(), None))
    return out


async def _window(bus: Any, chunk: list[tuple[Letter, int]], by: str, force: bool, dry_run: bool,
                  consumers: dict[tuple[str, str], asyncio.Future[Any]]) -> list[Result]:
    from nats.errors import NoRespondersError
    from nats.js.errors import NoStreamResponseError

    from ..schemas.catalog import Emit

    preps = await prepare(bus, [lt for lt, _ in chunk], force, consumers)
    results: list[Result | None] = [None] * len(chunk)
    sent: list[tuple[int, str, Any]] = []  # (index, source, the copy's ack future)
    ids = await bus.ids()
    for i, ((lt, attempt), prep) in enumerate(zip(chunk, preps, strict=True)):
        if isinstance(prep, Exception):
            results[i] = (Result(lt, "refused", str(prep), attempt=attempt) if isinstance(prep, Refused) else
                          Result(lt, "failed", f"not replayed: {type(prep).__name__}: {prep}", attempt=attempt))
            continue
        stream, body, original_headers, source = prep
        if dry_run:
            results[i] = Result(lt, "dry-run", stream=stream, source=source, attempt=attempt)
            continue
        headers = replay_headers(original_headers, lt, ids.wire(replay_msg_id(lt, attempt)))
        sent.append((i, source, await _send(bus, lt.original_subject, body, headers)))
    marks: list[tuple[int, str, Any]] = []
    for (i, source, _f), (ack, exc) in zip(sent, await _acks([f for _i, _s, f in sent]), strict=True):
        lt, attempt = chunk[i]
        if isinstance(exc, (NoStreamResponseError, NoRespondersError)):
            results[i] = Result(lt, "refused", f"no stream stores {lt.original_subject} now; not replayed", attempt=attempt)
        elif exc is not None:  # it may be stored all the same: its message id makes a second run store no second copy
            results[i] = Result(lt, "failed", f"its copy's publish failed ({type(exc).__name__}: {exc}); it may be stored: "
                                f"run the same replay again within 2 minutes (the same message id, deduplicated)",
                                attempt=attempt, source=source)
        else:
            results[i] = Result(lt, "replayed", stream=str(ack.stream), seq=int(ack.seq), source=source, attempt=attempt,
                                duplicate=bool(getattr(ack, "duplicate", False)))
            mark = DlqReplayed(stream=lt.stream, seq=lt.seq, letter_id=lt.id, subject=lt.original_subject,
                               consumer=lt.consumer, original_seq=lt.original_seq, replay_stream=str(ack.stream),
                               replay_seq=int(ack.seq), source=source, by=by, at=time.time(), attempt=attempt)
            (prepared,) = await bus.prepare([Emit(E.dlq_replayed, mark)])
            d = prepared.stored
            marks.append((i, source, await _send(bus, d.subject, d.body, d.headers)))
    for (i, _source, _f), (_ack, exc) in zip(marks, await _acks([f for _i, _s, f in marks]), strict=True):
        r = results[i]
        if exc is not None and r is not None:  # the copy is stored: say so, and that running it again stores no second one
            results[i] = Result(r.letter, "unmarked", f"replayed as {r.stream}:{r.seq} but not marked ({type(exc).__name__}: "
                                f"{exc}); run the same replay again within 2 minutes: its copy is the same message id, "
                                "deduplicated, and the mark is made", stream=r.stream, seq=r.seq, source=r.source,
                                attempt=r.attempt)
    return [r for r in results if r is not None]
