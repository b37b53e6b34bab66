"""The JetStream topology a ``Bus`` makes: the streams (``AIOS``, ``AIOS_INTAKE``,
``AIOS_OUTPUTS``, the observers' mirror ``AIOS_OBSERVE``) and the durable consumers (a mixin of
``bus.nats_bus.Bus``)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import structlog
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    DiscardPolicy,
    RetentionPolicy,
    StorageType,
    StreamConfig,
    StreamSource,
)
from nats.js.errors import BadRequestError, NotFoundError

from ..settings import Settings
from . import subjects

log = structlog.get_logger("aios.bus")


@dataclass(frozen=True)
class StreamLimits:
    max_age_s: float = 7 * 24 * 3600
    max_bytes: int = 8 * 1024**3
    duplicate_window_s: float = 120.0
    replicas: int = 1

    @classmethod
    def of(cls, s: Settings) -> StreamLimits:
        return cls(max_age_s=s.stream_max_age_s, max_bytes=s.stream_max_bytes, replicas=s.stream_replicas)


def _ours(cfg: ConsumerConfig) -> bool:
    """A worker durable as ``ensure_consumer`` makes it: pull, explicit acks, never expiring."""
    return not cfg.deliver_subject and cfg.ack_policy in (AckPolicy.EXPLICIT, None) and not cfg.inactive_threshold


class Topology:
    """``Bus``'s methods that make and inspect streams and consumers."""

    js: JetStreamContext
    settings: Settings
    atomic_streams: set[str]
    _no_atomic: set[str]

    # -- topology --------------------------------------------------------------------------
    async def ensure_stream(self, limits: StreamLimits | None = None) -> None:
        """Create the ``AIOS`` stream (limits retention over ``subjects.STREAM_SUBJECTS``) and the
        ``AIOS_OUTPUTS`` stream of the task outputs (its own limits, ``subjects.OUTPUT_STREAM_SUBJECTS``)
        and ``AIOS_INTAKE`` of the creates as sent (``AIOS``'s limits) if they do not exist; a stream made
        by an older version with other subjects is updated in place (``AIOS`` first: it gives up the
        create subjects before ``AIOS_INTAKE`` takes them)."""
        limits = limits or StreamLimits.of(self.settings)
        await self._ensure_one(subjects.STREAM, subjects.STREAM_SUBJECTS, limits)
        await self._ensure_one(subjects.STREAM_INTAKE, subjects.INTAKE_STREAM_SUBJECTS, limits)
        outputs = StreamLimits(max_age_s=self.settings.outputs_max_age_s, max_bytes=self.settings.outputs_max_bytes,
                               duplicate_window_s=limits.duplicate_window_s, replicas=limits.replicas)
        await self._ensure_one(subjects.STREAM_OUTPUTS, subjects.OUTPUT_STREAM_SUBJECTS, outputs)

    async def _ensure_one(self, name: str, subject_list: list[str], limits: StreamLimits) -> None:
        cfg = StreamConfig(
            name=name,
            subjects=subject_list,
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            discard=DiscardPolicy.OLD,
            max_age=limits.max_age_s,
            max_bytes=limits.max_bytes,
            duplicate_window=limits.duplicate_window_s,
            num_replicas=limits.replicas,
            max_msg_size=-1,
            allow_atomic=True,  # a fetched batch's events are committed together (``commit``)
        )
        try:
            info = await self.js.stream_info(name)
            if (info.config.num_replicas or 1) != limits.replicas:  # not changed here: a process
                # without the setting (default 1) would scale a replicated stream down
                log.warning("stream.replicas_differ", stream=name, replicas=info.config.num_replicas,
                            setting=limits.replicas, hint=f"nats stream edit {name} --replicas N")
            if sorted(info.config.subjects or []) != sorted(cfg.subjects or []) or not info.config.allow_atomic:
                info.config.subjects = cfg.subjects
                info.config.allow_atomic = True
                try:
                    await self.js.update_stream(info.config)
                except BadRequestError as exc:  # a server before 2.12: no atomic batches
                    log.warning("stream.atomic_unsupported", stream=name, error=str(exc))
                    info.config.allow_atomic = None
                    await self.js.update_stream(info.config)
                else:
                    log.info("stream.updated", stream=name, subjects=cfg.subjects, allow_atomic=True)
            self._note_atomic(name, bool(info.config.allow_atomic))
        except NotFoundError:
            try:
                info = await self.js.add_stream(cfg)
                log.info("stream.created", stream=name)
            except BadRequestError as exc:  # created concurrently by another process, or an old server
                if "already in use" not in str(exc) and "exists" not in str(exc):
                    raise
                info = await self.js.stream_info(name)
            self._note_atomic(name, bool(info.config.allow_atomic))

    async def ensure_observe_stream(self, limits: StreamLimits | None = None) -> bool:
        """Create ``AIOS_OBSERVE``, the observers' read-only mirror of ``AIOS``, if it does not exist
        (a missing one is rebuilt from ``AIOS``, every stored event). Observers may keep any consumer
        on it, unnamed and ordered ones included, which on ``AIOS`` they may not (the unnamed create
        names its consumer in the body, out of reach of permissions, and could update a worker's);
        no worker consumes it (docs/security.md). False, with a warning, when this connection may
        not create it or it is something else under that name; False, doing nothing, with
        ``AIOS_OBSERVE_MIRROR=0``."""
        if not self.settings.observe_mirror:
            return False
        limits = limits or StreamLimits.of(self.settings)
        name = subjects.STREAM_OBSERVE
        try:
            info = await self.js.stream_info(name)
        except NotFoundError:
            cfg = StreamConfig(name=name, mirror=StreamSource(name=subjects.STREAM), retention=RetentionPolicy.LIMITS,
                               storage=StorageType.FILE, discard=DiscardPolicy.OLD, max_age=limits.max_age_s,
                               max_bytes=limits.max_bytes, num_replicas=limits.replicas, max_msg_size=-1)
            try:
                await self.js.add_stream(cfg)
                log.info("stream.created", stream=name, mirror_of=subjects.STREAM)
                return True
            except BadRequestError as exc:
                if "already in use" in str(exc) or "exists" in str(exc):  # made concurrently
                    return True
                log.warning("stream.observe_missing", stream=name, error=str(exc))
                return False
            except Exception as exc:  # no right to create it (a worker or observer role): the admin's setup does
                log.warning("stream.observe_missing", stream=name, error=str(exc) or type(exc).__name__,
                            hint="run any `blocks` command as the admin, or `blocks up`, to create it")
                return False
        mirror = info.config.mirror
        if mirror is None or mirror.name != subjects.STREAM:
            log.warning("stream.observe_not_a_mirror", stream=name, mirror=mirror.name if mirror else None,
                        hint=f"nats stream rm {name}: the next setup recreates it as a mirror of {subjects.STREAM}")
            return False
        return True

    def _note_atomic(self, stream: str, allowed: bool) -> None:
        if not allowed:
            self._no_atomic.add(stream)
        else:
            self._no_atomic.discard(stream)
        if allowed and self.settings.atomic_batch_min > 0:
            self.atomic_streams.add(stream)
        else:
            self.atomic_streams.discard(stream)

    async def ensure_consumer(self, spec: subjects.ConsumerSpec, *, from_start: bool = True) -> None:
        cfg = ConsumerConfig(
            durable_name=spec.durable,
            filter_subjects=list(spec.filters),
            ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=DeliverPolicy.ALL if from_start else DeliverPolicy.NEW,
            ack_wait=30,
            max_deliver=-1,  # the runner counts deliveries and dead-letters (it knows the error)
            max_ack_pending=4096,
            max_waiting=512,
        )
        st = spec.stream
        try:
            info = await self.js.consumer_info(st, spec.durable)
            if not _ours(info.config):
                # made under our name by someone else (e.g. before the name was denied to observers):
                # a push or expiring consumer cannot be turned into ours, so it is replaced; our
                # position is not in it, and a fresh durable starts from the first message
                log.warning("bus.consumer_replaced", consumer=spec.durable, deliver_subject=info.config.deliver_subject,
                            inactive_threshold=info.config.inactive_threshold)
                await self.js.delete_consumer(st, spec.durable)
                await self.js.add_consumer(st, cfg)
            elif sorted(info.config.filter_subjects or [info.config.filter_subject or ""]) != sorted(spec.filters):
                await self.js.add_consumer(st, cfg)  # update filters in place
        except NotFoundError:
            await self.js.add_consumer(st, cfg)

    async def ensure_sidecar_consumer(self, spec: subjects.ConsumerSpec, max_deliver: int, ack_wait_s: float) -> None:
        """A side-car's durable on ``AIOS_OUTPUTS`` (every copy pulls from it: a queue group). The
        server redelivers after ``ack_wait_s`` and stops after ``max_deliver + 1`` deliveries (the
        SDK dead-letters at ``max_deliver``; the extra one leaves it room to do so). Named, with its
        one filter: nats-py then sends ``CONSUMER.CREATE.<stream>.<name>.<filter>``, the filter in the
        subject, which a side-car's user may be limited to (``runtime.sidecar_users``)."""
        one = spec.filters[0] if len(spec.filters) == 1 else None
        cfg = ConsumerConfig(
            name=spec.durable,
            durable_name=spec.durable,
            filter_subject=one,
            filter_subjects=None if one else list(spec.filters),
            ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=DeliverPolicy.ALL,
            ack_wait=ack_wait_s,
            max_deliver=max_deliver + 1,
            max_ack_pending=1024,
            max_waiting=512,
        )
        try:
            info = await self.js.consumer_info(spec.stream, spec.durable)
            same = (sorted(info.config.filter_subjects or [info.config.filter_subject or ""]) == sorted(spec.filters)
                    and info.config.max_deliver == cfg.max_deliver and float(info.config.ack_wait or 0) == float(ack_wait_s))
            if not same:
                await self.js.add_consumer(spec.stream, cfg)  # updated in place (position kept)
        except NotFoundError:
            await self.js.add_consumer(spec.stream, cfg)

    async def backlog(self, spec: subjects.ConsumerSpec) -> tuple[int, int] | None:
        """What a worker kind's durable has not finished: (messages not yet delivered, delivered and
        not acked). ``None`` when the consumer was never made (no worker of that kind ever ran): then
        the stream's message count is the backlog's upper bound (``stream_messages``)."""
        try:
            info = await self.js.consumer_info(spec.stream, spec.durable)
        except NotFoundError:
            return None
        return int(info.num_pending or 0), int(info.num_ack_pending or 0)

    async def stream_messages(self, stream: str) -> int:
        """How many messages ``stream`` holds (0 when it does not exist)."""
        try:
            return int((await self.js.stream_info(stream)).state.messages or 0)
        except NotFoundError:
            return 0

    async def delete_consumer(self, stream: str, durable: str) -> bool:
        """Delete a durable; ``False`` when there was none."""
        try:
            await self.js.delete_consumer(stream, durable)
            return True
        except NotFoundError:
            return False

    async def ensure_topology(self, consumers: Iterable[subjects.ConsumerSpec] = (), *, observe: bool = True) -> None:
        """Stream plus the shared consumers, so no message published before workers start is lost;
        with ``observe``, the observers' mirror too (``ensure_observe_stream``: callers that may
        create streams, the admin's setup and CLI; worker roles may not)."""
        await self.ensure_stream()
        if observe:
            await self.ensure_observe_stream()
        for spec in (subjects.PARSER, subjects.GATEWAY, subjects.controller(), subjects.LIFECYCLE, subjects.agent(), subjects.MAPPER,
                     *consumers):
            await self.ensure_consumer(spec)
