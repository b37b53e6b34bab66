"""What every worker shares: connections, the inventory snapshot, the policy runtime, and the
plumbing that binds handlers to consumers through the one runner."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import signal
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
import structlog

from ..bus import subjects
from ..bus.catalog import E, Emit
from ..bus.nats_bus import Bus
from ..bus.router import TRIGGER_SEQ, Inbound
from ..bus.runner import ConsumerRunner, CoreRunner, Defer, Delivery, RunnerOptions
from ..policies import capacity, contract, node_digest
from ..policies.runtime import PolicyRuntime, TrackingDict, stateless
from ..runtime.auth import url_user
from ..schemas import roles
from ..schemas.errors import PolicyFailed
from ..schemas.events import (
    BlockStatusReport,
    Decision,
    InventoryHint,
    input_digest,
    input_digest_later,
    node_map,
    with_nodes,
)
from ..schemas.lifecycle import Step
from ..schemas.records import AffinityIndex, BlockIR
from ..settings import Settings
from ..settings import load as load_settings
from ..state.inventory import Inventory, affinity_index
from ..state.store import Store
from . import announce

log = structlog.get_logger("aios.worker")

IR_CACHE = 4096  # blocks whose IR a worker keeps (``Worker.block_ir``)
#: actions whose inputs ``recovery.inputs`` rebuilds by replay; any other call (autoscale,
#: health_check, scale_down: their inputs hold live metrics and instance loads, not stream facts)
#: keeps its input in the record, up to INLINE_INPUT_MAX bytes
REPLAYED_ACTIONS = frozenset({"selection", "post_dry_run", "dry_run", "allocation", "scale", "reassignment"})
INLINE_INPUT_MAX = 256 * 1024


class LaterDigests:
    """The decision records made inside it (``with``: ``Worker.record`` in this task) get their
    input's digest when :meth:`finish` is called, not at once: what reads the node map (a live
    inventory view, changed in place) is taken at the call, the JSON and hash of the rest of the
    input later (``events.input_digest_later``). The allocation computes them while its
    reservation's script is in flight (``workers.allocate``); it finishes them before any of them
    can be published, and leaving the block by an exception finishes them at once."""

    def __init__(self) -> None:
        self.pending: list[tuple[Decision, Callable[[], str]]] = []
        self._token: contextvars.Token[LaterDigests | None] | None = None

    def __enter__(self) -> LaterDigests:
        self._token = _LATER.set(self)
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        if self._token is not None:
            _LATER.reset(self._token)
            self._token = None
        if exc_type is not None:
            self.finish()

    def finish(self) -> None:
        pending, self.pending = self.pending, []
        for decision, digest in pending:
            decision.input_digest = digest()


_LATER: contextvars.ContextVar[LaterDigests | None] = contextvars.ContextVar("aios_later_digests", default=None)


def encode_input(input_data: dict[str, Any]) -> bytes:
    """``msgspec.json.encode(input_data)``, byte for byte, with the node views of a placement's
    payload (``cluster_metrics.nodes``) taken from their per-view encoding (``capacity.encoded``)."""
    if node_map(input_data) is None:
        return msgspec.json.encode(input_data)
    return msgspec.json.encode(with_nodes(input_data, capacity.encoded))


#: the worker kinds that read the node inventory (``Worker.inventory``: the gateway's filter, the
#: controller's placements and virtual clusters); the others never do, so they take no hints
INVENTORY_KINDS = roles.INVENTORY_KINDS


@dataclass
class Worker:
    bus: Bus
    store: Store
    inventory: Inventory
    runtime: PolicyRuntime
    name: str
    settings: Settings = field(default_factory=load_settings)
    _subs: list[Any] = field(default_factory=list)
    #: this process, in the inventory hints it sends (it skips its own when they come back)
    origin: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    #: (block, gen) -> IR: a generation's IR never changes, and its dry_runs come together
    _irs: OrderedDict[tuple[str, int], BlockIR] = field(default_factory=OrderedDict)
    _ir_reads: dict[tuple[str, int], asyncio.Future[BlockIR | None]] = field(default_factory=dict)
    #: cluster -> nodes changed this turn of the loop, not yet hinted (``hint``), and the sends
    _hints: dict[str, set[str]] = field(default_factory=dict)
    _hint_tasks: set[asyncio.Task[Any]] = field(default_factory=set)

    @classmethod
    async def open(cls, nats_url: str, redis_url: str, name: str, settings: Settings | None = None) -> Worker:
        """A worker of kind ``name``; only the kinds that read the inventory (``INVENTORY_KINDS``)
        take the inventory hints (one per reservation: every other worker would decode each for
        nothing, and nats-server deliver it to them)."""
        s = settings or load_settings()
        bus = await Bus.open(nats_url, source=f"aios-blocks/{name}", settings=s)
        store = Store.open(redis_url, settings=s)
        runtime = PolicyRuntime(lookup=store.policy_get, timeout_s=s.policy_timeout_s, python_sandbox=s.python_policy_sandbox)
        w = cls(bus, store, Inventory(store), runtime, name, s)
        # a worker role may not create streams; the observers' mirror is the admin's setup's, unless
        # the servers need no credentials (AIOS_AUTH=0: nobody else may come to make it)
        await bus.ensure_topology(observe=url_user(nats_url) is None)
        from ..recovery.rebuild import ensure_epoch

        await ensure_epoch(bus, store)
        await w._watch_hints(inventory=name in INVENTORY_KINDS)
        return w

    async def _watch_hints(self, inventory: bool = True) -> None:
        async def on_inventory(msg: Any) -> None:
            with contextlib.suppress(Exception):
                hint = msgspec.json.decode(msg.data)
                if hint.get("origin") != self.origin:  # our own: our view is already up to date
                    self.inventory.on_hint(hint)

        async def on_policy(msg: Any) -> None:
            toks = E.policy_updated.match(msg.subject)
            if toks:
                self.runtime.forget(toks["name"])

        if inventory:
            self._subs.append(await self.bus.subscribe(subjects.INVENTORY_ALL, on_inventory))
        self._subs.append(await self.bus.subscribe(subjects.POLICY_UPDATED_ALL, on_policy))

    async def close(self) -> None:
        await self.bus.close()
        await self.store.close()

    async def invoke(self, ir: BlockIR, kind: str, input_data: dict[str, Any], trace: list[Decision] | None = None) -> Any:
        """Run the block's ``kind`` policy with its Redis-backed context (raises PolicyFailed). Its
        decision record goes into ``trace`` (the step's event carries it) or, without one, out as
        a ``decision`` event of its own."""
        rule = ir["policies"][kind]
        rule_id = f"{ir['blockId']}.{kind}"
        # the built-ins never touch their context: no Redis read (nor write) for them
        ctx = TrackingDict({} if stateless(rule.get("policyRuleURI", "")) else await self.store.context_load(rule_id))
        started = time.perf_counter()
        result, error = None, ""
        call: dict[str, Any] = {}  # a literal: ``dict[str, Any]()`` built a generic alias per call
        try:
            result = await self.runtime.invoke(rule, rule_id, input_data, ctx, call)
        except PolicyFailed as exc:
            error = exc.reason
            raise
        finally:
            decision = await self.record(
                ir["blockId"], kind, rule, input_data, result, error, time.perf_counter() - started, call.get("logs", []),
                # a record that goes out on its own (no trace) is published now: its digest too
                later=_LATER.get() if trace is not None else None,
            )
            if trace is not None:
                trace.append(decision)
            else:
                await self.bus.emit(E.block_decision, decision)
        changed, deleted = ctx.changes()
        if changed or deleted:
            await self.store.context_save(rule_id, changed, deleted)
        return result

    async def record(
        self, bid: str, kind: str, rule: dict[str, Any], input_data: dict[str, Any], output: Any, error: str, seconds: float,
        logs: list[list[str]] | None = None, later: LaterDigests | None = None,
    ) -> Decision:
        """The decision record of one policy call. A placement step's input is not stored: the
        record names the state version it was built from (the stream sequence of the message being
        handled), the input's digest and the parts of it that are not in the stream;
        ``recovery.inputs`` rebuilds it by replay. Other calls keep their input inline
        (``REPLAYED_ACTIONS``). With ``later`` its digest is set when ``later`` finishes."""
        digest_later = input_digest_later(input_data, node_digest.nodes_root)
        digest = "" if later is not None else digest_later()
        given: dict[str, Any] = {}
        payload = input_data.get("payload")
        if isinstance(payload, dict) and "block_metrics" in payload:
            # the bytes as they were at the call: the record is published later
            given["block_metrics"] = msgspec.Raw(msgspec.json.encode(payload["block_metrics"]))
        if isinstance(payload, dict) and payload.get("excluded_nodes"):  # suspect / avoided nodes: not in the stream
            given["excluded_nodes"] = dict(payload["excluded_nodes"])
        action = str(input_data.get("action", "?"))
        inline: Any = None
        where = ""
        if action not in REPLAYED_ACTIONS:  # not rebuilt by replay: the record holds it
            raw = encode_input(input_data)
            if len(raw) <= INLINE_INPUT_MAX:
                inline = msgspec.Raw(raw)
            else:
                where = f"(not stored: {len(raw)} bytes)"
        whole = msgspec.json.encode(output)
        kept, out_digest = whole, ""
        with contextlib.suppress(Exception):  # an output of the wrong shape is kept whole
            part = contract.essential(action, output)
            if part is not output:
                kept, out_digest = msgspec.json.encode(part), input_digest(whole)
        decision = Decision(
            bid, kind, rule.get("name", kind), rule.get("policyRuleURI", ""), rule.get("version"), action, digest,
            msgspec.Raw(kept), error, int(seconds * 1e6), inline, where, logs=logs or [], at=TRIGGER_SEQ.get(), given=given,
            output_digest=out_digest,
        )
        if later is not None:
            later.pending.append((decision, digest_later))
        return decision

    async def block_ir(self, bid: str, gen: int) -> BlockIR | None:
        """The IR of generation ``gen`` of a block (None: the block is gone or another generation
        now), read once and kept for the block's other requests."""
        key = (bid, gen)
        ir = self._irs.get(key)
        if ir is not None:
            return ir
        # one read for the requests of a block that arrive together (its dry_runs to each
        # candidate cluster this controller serves): the others wait for the first
        pending = self._ir_reads.get(key)
        if pending is None:
            pending = self._ir_reads[key] = asyncio.ensure_future(self._read_ir(key))
            pending.add_done_callback(lambda _f: self._ir_reads.pop(key, None))
        return await asyncio.shield(pending)

    async def _read_ir(self, key: tuple[str, int]) -> BlockIR | None:
        bid, gen = key
        block = await self.store.get_block(bid)
        if block is None or block.get("gen") != gen or not block.get("ir"):
            return None
        ir = self._irs[key] = block["ir"]
        if len(self._irs) > IR_CACHE:
            self._irs.popitem(last=False)
        return ir

    def invoker(self, ir: BlockIR, kind: str, trace: list[Decision] | None = None) -> Callable[[dict[str, Any]], Awaitable[Any]]:
        async def call(input_data: dict[str, Any]) -> Any:
            return await self.invoke(ir, kind, input_data, trace)

        return call

    async def affinity_index(self, ir: BlockIR) -> AffinityIndex:
        """Where the instances/blocks named by the block's affinity targets run now."""
        return await affinity_index(self.store, ir)

    async def hint(self, cid: str, nodes: list[str] | None, applied: bool = False) -> None:
        """Tell every worker that these nodes changed; ``None``: the whole cluster and the cluster
        list. This one's view is marked stale too, unless ``applied`` (it was updated in place,
        ``Inventory.apply``)."""
        if not applied:
            self.inventory.invalidate(cid, nodes)
        if nodes is None:
            await self.bus.emit(E.inventory_hint, InventoryHint(cid, nodes, self.origin))
            return
        # the nodes this turn of the event loop changed go out as one hint per cluster (a batch's
        # reservations are handled together: a hint each was a message each for every reader)
        if not self._hints:
            asyncio.get_running_loop().call_soon(self._send_hints)
        self._hints.setdefault(cid, set()).update(nodes)

    def _send_hints(self) -> None:
        held, self._hints = self._hints, {}
        for cid, nodes in held.items():
            t = asyncio.get_running_loop().create_task(
                self.bus.emit(E.inventory_hint, InventoryHint(cid, sorted(nodes), self.origin)))
            self._hint_tasks.add(t)
            t.add_done_callback(self._hint_sent)

    def _hint_sent(self, t: asyncio.Task[Any]) -> None:
        self._hint_tasks.discard(t)
        if not t.cancelled() and t.exception() is not None:  # a lost hint costs a stale read, no more
            log.warning("inventory.hint_failed", error=repr(t.exception()))

    async def fail_block(self, bid: str, gen: int, reason: str, step: Step, cluster: str = "") -> None:
        """Move the block to ``failed`` by ``step`` (CAS) and publish the failed event with the reason."""
        failed = Emit(E.block_failed, BlockStatusReport(block_id=bid, gen=gen, status="failed", reason=reason, cluster_id=cluster))
        key = await announce.mark(self, bid, gen, step, [failed])  # published again if this publish fails
        ok, info = await self.store.transition(bid, gen, step, reason=reason)
        moved = ok or info == "failed"
        if moved:  # else the block moved on (deleted, re-created): nothing to report
            await self.bus.emit_all([failed])
        await announce.settle(self, key, moved)


M = TypeVar("M")


def bound(fn: Callable[[Worker, Inbound[M]], Awaitable[None]], w: Worker) -> Callable[[Inbound[M]], Awaitable[None]]:
    """A module-level handler ``fn(w, m)`` with its worker given. It still names ``fn``
    (``__module__``, ``__qualname__``, ``__wrapped__``), so ``blocks subjects`` goes from a subject
    to its function in one jump (``runtime.routes``)."""
    return functools.update_wrapper(functools.partial(fn, w), fn)


async def run_consumers(
    worker: Worker,
    bindings: list[tuple[subjects.ConsumerSpec, Callable[[Delivery], Awaitable[None]]]],
    stop: asyncio.Event,
    options: RunnerOptions | None = None,
) -> None:
    for spec, _ in bindings:
        if spec.filters:
            await worker.bus.ensure_consumer(spec)
    guard = EpochGuard(worker)
    opts = options or RunnerOptions(batch=worker.settings.consumer_batch, concurrency=worker.settings.consumer_inflight)
    # a durable consumer for the stored events, a queue group for the queries (core NATS)
    runners = [ConsumerRunner(worker.bus, spec, handler, opts, guard) for spec, handler in bindings if spec.filters]
    runners += [CoreRunner(worker.bus, spec, handler, opts, guard) for spec, handler in bindings if spec.core_filters]
    await asyncio.gather(*(r.run(stop) for r in runners))


class EpochProbe:
    """Reads of the state epoch, shared: every caller of :meth:`after` gets the result of a read
    that *started after it called* (so it proves what the caller needs), but callers that arrive
    while a read is in flight share the next one. A burst of handlers finishing together costs one
    or two ``GET``s, not one each."""

    def __init__(self, store: Store):
        self.store = store
        self._next: asyncio.Future[str | None] | None = None
        self._reading = False
        #: the read loop's task, held: the loop keeps only a weak reference to a task, and one
        #: collected mid-read would leave its callers waiting on a future nobody sets
        self._task: asyncio.Task[None] | None = None
        #: the last value read and when (monotonic)
        self.last: tuple[float, str | None] = (float("-inf"), None)

    async def after(self) -> str | None:
        if self._next is None:
            self._next = asyncio.get_running_loop().create_future()
        fut = self._next
        if not self._reading:
            self._reading = True
            self._task = asyncio.get_running_loop().create_task(self._read_loop())
        return await fut

    async def _read_loop(self) -> None:
        try:
            while self._next is not None:
                fut, self._next = self._next, None
                try:
                    value = await self.store.epoch()
                except Exception as exc:
                    if not fut.done():
                        fut.set_exception(exc)
                    continue
                self.last = (time.monotonic(), value)
                if not fut.done():
                    fut.set_result(value)
        finally:
            self._reading = False


class EpochGuard:
    """Handlers act only while Redis holds valid state (``recovery.rebuild``): with the epoch key
    gone (Redis flushed, or ``blocks recover`` under way) a batch is deferred, not handled, so
    nothing is acked on the strength of an empty Redis; a batch whose handling overlapped an
    epoch change is redone. A new epoch drops the worker's inventory cache.

    The consumer runner checks it once per fetched batch (``bus.runner.Guard``): before, with a
    read at most ``fresh_s`` old (:meth:`current`); after the handlers and their publishes, with
    a read that started after them (:meth:`still`, shared with the batches that finished at the
    same time, ``EpochProbe``). A flush inside the ``fresh_s`` window is caught by the check
    after, which redoes the batch (handlers are idempotent) instead of acking it."""

    def __init__(self, worker: Worker, pause_s: float = 1.0, fresh_s: float = 0.05):
        self.worker = worker
        self.pause_s = pause_s
        self.fresh_s = fresh_s
        self.seen: str | None = None
        self.probe = EpochProbe(worker.store)

    async def current(self) -> str:
        at, epoch = self.probe.last
        if epoch is None or time.monotonic() - at > self.fresh_s:
            epoch = await self.probe.after()
        if epoch is None:
            from ..recovery.rebuild import ensure_epoch

            epoch = await ensure_epoch(self.worker.bus, self.worker.store)
            if epoch is None:
                log.warning("state.no_epoch", worker=self.worker.name, hint="Redis lost its state: run blocks recover")
                raise Defer(self.pause_s)
        if epoch != self.seen:
            if self.seen is not None:
                log.info("state.new_epoch", worker=self.worker.name, epoch=epoch)
                self.worker.inventory = Inventory(self.worker.store)
            self.seen = epoch
        return epoch

    async def still(self, epoch: str) -> bool:
        """Whether ``epoch`` is still the state's, by a read that started after this call."""
        return await self.probe.after() == epoch

    def wrap(self, handler: Callable[[Delivery], Awaitable[None]]) -> Callable[[Delivery], Awaitable[None]]:
        """One message guarded on its own (the runner guards whole batches instead)."""

        async def guarded(d: Delivery) -> None:
            before = await self.current()
            await handler(d)
            if not await self.still(before):
                raise Defer(self.pause_s)  # state was replaced while we worked: do it again

        return guarded


def stop_on_signals() -> asyncio.Event:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    return stop
