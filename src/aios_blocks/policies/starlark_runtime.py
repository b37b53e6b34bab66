"""Sandboxed Starlark policies (``starlark-pyo3``), in the seed-000 class shape.

:func:`compile_policy` turns Starlark source into a class that :class:`~.runtime.PolicyRuntime`
treats exactly like a Python policy class: ``cls(rule_id, settings, parameters)`` and then
``inst.eval(parameters, input_data, context)`` returning plain Python dicts/lists. The form is
detected from the source (a top-level ``def`` at column 0):

``def eval(parameters, input_data, context)`` - the seed-000 form
    Returns the same shapes as the Python classes. ``settings`` (dict), ``rule_id`` (str) and
    ``init_parameters`` (the rule's parameters given to ``__init__``) are predeclared module
    globals, readable at top level and in functions. Whatever the script stores in ``context``
    (a fresh Starlark dict per call) is copied back into the caller's dict after a successful
    call: changed/new keys are assigned, removed keys are deleted. A failed call changes nothing.

``def instance_placement(request, candidate_members)`` - the LXD placement scriptlet form
    Used as a resourceAllocator. For ``allocation``/``scale``/``reassignment`` it is called once
    with an LXD-shaped ``request`` and one candidate member per healthy node that can host one
    instance (``capacity.node_fits``; Required affinity honoured; for ``reassignment`` the
    instance's current node is left out unless it is the only one). The scriptlet picks a node
    with ``set_target(member_name)``; GPUs on that node are chosen by a built-in picker (Required,
    then preferred GPUs, then lowest free memory first, i.e. bin-pack). Result:
    ``{"node_id": target, "gpus": [...]}``. A non-None return value rejects the placement
    (``StarlarkError("placement rejected: <msg>")``); returning without ``set_target`` is an
    error too. ``dry_run`` calls the scriptlet up to ``maxInstances`` times on a working copy of
    the nodes (``capacity.take`` after each choice) and returns
    ``{"selection_score_data": {"score": placed / maxInstances, "node_info": first}}``; a
    rejection or missing ``set_target`` on the first call raises, a rejection on a later call
    just stops counting (the script said "no more here"), no candidates left stops counting.
    Host functions: ``set_target``, ``get_cluster_member_state``, ``get_cluster_member_resources``,
    ``get_instance_resources``, ``log_info``/``log_warn``/``log_error``. ``settings``,
    ``rule_id`` and ``init_parameters`` are predeclared here too.

Both forms get ``log_info``/``log_warn``/``log_error(*messages)``; the last call's lines are on the
instance as ``self.logs: list[tuple[level, message]]`` (also after a failed call) and go to the
``aios_blocks.policies.starlark`` logger.

Values cross the boundary by conversion (dicts, lists, str, int, float, bool, None; tuples
become lists, dict keys must be strings). Starlark dicts have no attribute access, so to let
scriptlets write both ``member.server_name`` and ``member["server_name"]`` (the seed-004 examples
use both) the source is rewritten before compiling: an attribute read ``x.name`` that is not a
call (``x.name(`` is left alone) nor an assignment target becomes ``x["name"]``. Line numbers
are kept (columns in messages may shift). Consequence: a method reference without a call
(``f = d.get``) is read as a key lookup; call methods directly.

Sandbox (what is real, what is not)
-----------------------------------
* No I/O: standard globals only (no ``print``, ``open``, time, os, json, struct); ``load()`` is
  disabled in the dialect (a compile error); the only host functions are the ones above, which
  read the call's payload. Module globals are frozen after the top level runs: a script cannot
  keep state between calls except through ``context``.
* Time: :attr:`Limits.timeout_s` per ``eval`` call (shared by all placement calls of one
  dry_run) and for the top level in ``__init__``, via ``check_cancelled`` with a deadline.
  starlark-rust polls it about every 1000 loop iterations, so a loop is stopped within
  ``timeout_s`` plus up to ~1000 of its iterations (2000 iterations of ``len([0] * 100000)``
  ran 4 s with 2 polls); a single long builtin (``sorted`` of a huge list,
  ``"x" * 1000000000``) cannot be interrupted. The interpreter holds the GIL while it runs
  (it only yields inside callbacks), so a long call stalls the process's other threads and its
  event loop until the next poll; the runtime's own ``asyncio.wait_for`` cannot fire earlier.
* Recursion: :attr:`Limits.max_callstack` frames (``max_callstack_size``), clamped to
  :data:`MAX_CALLSTACK` because a very deep Starlark stack overflows the native thread stack and
  segfaults the process (seen at ~50000 frames on an 8 MiB thread stack).
* Memory: starlark-pyo3 (2026.1.3) exposes no heap limit (EvalOptions has only
  ``check_cancelled`` and ``max_callstack_size``) and starlark-rust aborts the process when an
  allocation fails. What is refused: a repeat count that does not fit in i32
  (``[0] * (1 << 40)``, ``"x" * (1 << 40)``: "Integer value is too big to fit in i32"), which
  becomes a StarlarkError and the process carries on. What is NOT refused: ``[0] * 100000000``
  succeeds in one step (~1.5 GB peak, ~4 s, no poll in between); ``list(range(100000000))``
  asks for ~11 GB in one allocation and where that fails the whole process aborts (SIGABRT,
  seen under a 4 GB ``ulimit -v``). Polling RSS from ``check_cancelled`` would not help: the
  poll comes every ~1000 loop iterations, after the allocation. A real memory bound for
  untrusted tenants needs a child process with an address-space limit.
"""

from __future__ import annotations

import io
import json
import logging
import re
import threading
import time
import tokenize
from dataclasses import dataclass
from typing import Any, ClassVar

import starlark as sl

from ..schemas.lxd import (
    ClusterMember,
    InstanceResources,
    LxdArgs,
    LxdGiven,
    LxdOutcome,
    MemberResources,
    MemberState,
    PlacementRequest,
)
from ..schemas.records import (
    DryRunAnswer,
    JSONObject,
    Needs,
    NodeView,
    Placement,
    PlacementPayload,
    PolicyBlock,
    PolicyInput,
)
from . import capacity
from .lxd_shapes import (  # noqa: F401 - the LXD shapes are part of this module's interface
    MiB,
    _given,
    cluster_member,
    instance_resources,
    member_resources,
    member_state,
    pick_gpus,
    placement_request,
)

if not hasattr(sl, "EvalOptions"):  # EvalOptions / FrozenModule.call_with arrived in 2026.1.1
    raise ImportError("aios_blocks.policies.starlark_runtime needs starlark-pyo3 >= 2026.1.1 (EvalOptions)")

log = logging.getLogger("aios_blocks.policies.starlark")

#: hard cap on Limits.max_callstack (deeper native recursion can segfault a thread)
MAX_CALLSTACK = 2000
#: per call: log lines kept and characters per line
MAX_LOG_LINES = 1000
MAX_LOG_CHARS = 4000

SEED_FORM = "eval"
LXD_FORM = "instance_placement"
_WRAPPER = "aios_call__eval"
_FNS = "aios_fns__"
_STATIC_SENTINEL = "aios-static-check-reached"

LOG_FUNCS = ("log_info", "log_warn", "log_error")
LXD_FUNCS = ("set_target", "get_cluster_member_state", "get_cluster_member_resources", "get_instance_resources")
PREDECLARED = ("settings", "rule_id", "init_parameters")


class StarlarkError(Exception):
    """A Starlark policy failed to compile, raised, returned something unusable or hit a limit.

    ``str(exc)`` is one readable line (policy name, what failed, the script's own error text and
    ``file:line:col`` where starlark gives it); ``text`` is starlark's full message (traceback
    and source snippet); ``line`` the script line (or None)."""

    def __init__(self, message: str, *, text: str = "", line: int | None = None):
        super().__init__(message)
        self.text = text or message
        self.line = line


@dataclass(frozen=True)
class Limits:
    #: wall-clock budget of one eval() call (and of the module's top level in __init__)
    timeout_s: float = 2.0
    #: Starlark call-stack depth (clamped to 1..MAX_CALLSTACK)
    max_callstack: int = 200

    def callstack(self) -> int:
        return max(1, min(int(self.max_callstack), MAX_CALLSTACK))


# -- compiling -----------------------------------------------------------------------------------


def _dialect() -> sl.Dialect:
    d = sl.Dialect.standard()
    d.enable_load = False
    return d


_GLOBALS = sl.Globals.standard()
_FORM_RE = {form: re.compile(rf"^def\s+{form}\s*\(", re.M) for form in (SEED_FORM, LXD_FORM)}
_ASSIGN_OPS = {"=", "+=", "-=", "*=", "/=", "//=", "%=", "&=", "|=", "^=", "<<=", ">>="}
_SKIP = {tokenize.NL, tokenize.COMMENT, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT}


def attribute_reads_as_keys(source: str) -> str:
    """``x.name`` -> ``x["name"]`` for attribute reads that are not calls or assignment targets.

    Token based (Starlark's lexical syntax is Python's), so strings and comments are untouched
    and line numbers are kept. If the source does not tokenize it is returned unchanged (the
    Starlark parser then reports the real error)."""
    try:
        toks = [t for t in tokenize.generate_tokens(io.StringIO(source).readline)]
    except (tokenize.TokenError, SyntaxError):
        return source
    # (row, start col, end col, replacement)
    edits = [(tok.start[0], tok.start[1], toks[i + 1].end[1], f'["{toks[i + 1].string}"]')
             for i, tok in enumerate(toks) if _is_attribute_read(toks, i)]
    if not edits:
        return source
    lines = source.splitlines(keepends=True)
    for row, c0, c1, text in sorted(edits, reverse=True):
        line = lines[row - 1]
        lines[row - 1] = line[:c0] + text + line[c1:]
    return "".join(lines)


def _is_attribute_read(toks: list[tokenize.TokenInfo], i: int) -> bool:
    """Whether token ``i`` is the dot of ``x.name`` read as a value (not called, not assigned to)."""
    tok = toks[i]
    if tok.type != tokenize.OP or tok.string != "." or i == 0 or i + 1 >= len(toks):
        return False
    prev, name = toks[i - 1], toks[i + 1]
    if name.type != tokenize.NAME or name.start[0] != tok.start[0]:
        return False
    if not (prev.type in (tokenize.NAME, tokenize.STRING) or (prev.type == tokenize.OP and prev.string in ")]}")):
        return False
    nxt = next((t for t in toks[i + 2 :] if t.type not in _SKIP), None)
    return not (nxt is not None and nxt.type == tokenize.OP and (nxt.string == "(" or nxt.string in _ASSIGN_OPS))


def detect_form(source: str, name: str = "policy") -> str:
    """``"eval"`` or ``"instance_placement"``: which entry point the source defines at top level."""
    found = [form for form, rx in _FORM_RE.items() if rx.search(source)]
    if len(found) != 1:
        what = "both" if found else "neither"
        raise StarlarkError(
            f"{name}: a Starlark policy must define exactly one of `def eval(parameters, input_data, context)` or "
            f"`def instance_placement(request, candidate_members)` at top level; this source defines {what}"
        )
    return found[0]


@dataclass
class _Program:
    name: str
    form: str
    ast: Any  # starlark.AstModule of the rewritten source (+ wrapper); reusable across evaluations
    limits: Limits


def compile_policy(source: str, name: str, limits: Limits | None = None) -> type[_StarlarkPolicy]:
    """Parse and statically check Starlark policy source; return a seed-000 policy class.

    Syntax errors, ``load()``, undefined names and bad assignment targets raise
    :class:`StarlarkError` here, without running any of the script. The top level runs once per
    instance (in ``__init__``, with ``settings``/``rule_id``/``init_parameters`` set)."""
    limits = limits or Limits()
    filename = name if name.endswith(".star") else f"{name}.star"
    for reserved in (_WRAPPER, _FNS):
        if reserved in source:
            raise StarlarkError(f"{name}: the name {reserved!r} is reserved")
    try:
        sl.parse(filename, source, _dialect())  # errors reported against the source as written
    except sl.StarlarkError as exc:
        raise _from_starlark(exc, name, "does not compile") from None
    form = detect_form(source, name)
    body = attribute_reads_as_keys(source)
    if not body.endswith("\n"):
        body += "\n"
    if form == SEED_FORM:
        # The function is looked up by a runtime key: starlark-rust inlines small frozen functions
        # into a caller that names them statically, and errors would then point at this wrapper.
        body += (
            f'\n{_FNS} = {{"eval": eval}}\n'
            f"def {_WRAPPER}(fn, parameters, input_data, context):\n"
            f"    return [{_FNS}[fn](parameters, input_data, context), context]\n"
        )
    try:
        ast = sl.parse(filename, body, _dialect())
    except sl.StarlarkError as exc:
        raise _from_starlark(exc, name, "does not compile") from None
    _static_check(filename, body, name, form)
    program = _Program(name, form, ast, limits)
    base = _SeedPolicy if form == SEED_FORM else _PlacementPolicy
    cls_name = "Starlark_" + (re.sub(r"\W", "_", name) or "policy")
    return type(cls_name, (base,), {"_program": program, "__doc__": f"Starlark policy {name!r} ({form} form)."})


def _static_check(filename: str, body: str, name: str, form: str) -> None:
    """Resolve names and compile the whole module without executing the script: starlark-rust
    compiles the module before running it, and the first statement we prepend fails at once."""
    ast = sl.parse(filename, f'fail("{_STATIC_SENTINEL}")\n' + body, _dialect())
    mod = sl.Module()
    for key in PREDECLARED:
        mod[key] = {} if key != "rule_id" else ""
    for fname in LOG_FUNCS + (LXD_FUNCS if form == LXD_FORM else ()):
        mod.add_callable(fname, _never_called)
    try:
        sl.eval_with(sl.EvalOptions(check_cancelled=lambda: True), mod, ast, _GLOBALS)
    except sl.StarlarkError as exc:
        text = str(exc)
        if _STATIC_SENTINEL in text or _location(text)[1] == 1:
            return
        raise _from_starlark(exc, name, "does not compile", line_offset=-1) from None
    raise StarlarkError(f"{name}: static check did not stop (internal error)")


def _never_called(*_a: Any) -> None:
    raise RuntimeError("host function called during the static check")


# -- errors --------------------------------------------------------------------------------------

_LOC_RE = re.compile(r"-->\s*([^\s:]+):(\d+):(\d+)")
_FRAME_RE = re.compile(r"^\s*\*\s*([^\s:]+):(\d+), in (\S+)", re.M)


def _location(text: str) -> tuple[str, int | None, int | None]:
    m = _LOC_RE.search(text)
    if m:
        return m.group(1), int(m.group(2)), int(m.group(3))
    frames = _FRAME_RE.findall(text)
    if frames:
        return frames[-1][0], int(frames[-1][1]), None
    return "", None, None


def _error_line(text: str) -> str:
    for line in text.splitlines():
        if line.startswith("error: "):
            return line[len("error: ") :].strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[0] if lines else "unknown error"


def _from_starlark(exc: BaseException, name: str, what: str, *, line_offset: int = 0) -> StarlarkError:
    text = str(exc)
    msg = _error_line(text)
    fname, line, col = _location(text)
    if line is not None:
        line += line_offset
    where = f" (at {fname}:{line}{'' if col is None else f':{col}'})" if line is not None else ""
    return StarlarkError(f"{name}: {what}: {msg}{where}", text=text, line=line)


# -- calling -------------------------------------------------------------------------------------


class _CallState:
    """Per-call state the host functions see (thread-local: one instance may run concurrently)."""

    def __init__(self, timeout_s: float):
        self.deadline = time.monotonic() + timeout_s
        self.timed_out = False
        self.logs: list[tuple[str, str]] = []
        self.dropped = 0
        # placement form
        self.nodes: dict[str, NodeView] = {}
        self.all_nodes: dict[str, NodeView] = {}
        self.members: dict[str, ClusterMember] = {}
        self.needs: Needs = {}
        self.target: str | None = None
        # raw LXD mode (``run_lxd``): what the helpers return, given by the caller as LXD shapes
        self.raw: LxdGiven | None = None

    def cancelled(self) -> bool:
        if time.monotonic() >= self.deadline:
            self.timed_out = True
            return True
        return False


class _Host:
    """The host functions a module calls. Holds no reference to the policy instance or module:
    the FrozenModule (a Rust object the cycle collector cannot see through) keeps these
    callables alive, so a back reference would make every instance uncollectable."""

    def __init__(self, name: str, rule_id: str):
        self.name = name
        self.rule_id = rule_id
        self.tls = threading.local()  # .state: the _CallState of this thread's running call

    def state(self) -> _CallState:
        state = getattr(self.tls, "state", None)
        if state is None:
            raise RuntimeError("host function called outside a policy call")
        return state

    def logger(self, level: str) -> Any:
        pyl = {"info": logging.INFO, "warn": logging.WARNING, "error": logging.ERROR}[level]

        def log_fn(*messages: Any) -> None:
            state = self.state()
            if len(state.logs) >= MAX_LOG_LINES:
                state.dropped += 1
                return None
            text = "".join(m if isinstance(m, str) else _star_repr(m) for m in messages)[:MAX_LOG_CHARS]
            state.logs.append((level, text))
            log.log(pyl, "starlark policy %s [%s]: %s", self.name, self.rule_id, text)
            return None

        return log_fn

    def set_target(self, member_name: Any) -> None:
        state = self.state()
        if not isinstance(member_name, str) or member_name not in state.members:
            names = ", ".join(sorted(state.members)) or "none"
            raise ValueError(f"set_target: {member_name!r} is not a candidate member (candidates: {names})")
        state.target = member_name
        return None

    def node(self, member_name: Any) -> NodeView:
        state = self.state()
        found = None
        if isinstance(member_name, str):
            found = state.nodes.get(member_name) or state.all_nodes.get(member_name)
        if found is None:
            raise ValueError(f"unknown cluster member {member_name!r}")
        return found

    def get_cluster_member_state(self, member_name: Any) -> MemberState:
        raw = self.state().raw
        if raw is None:
            return member_state(self.node(member_name))
        return _given(raw["member_state"], "member_state", member_name)

    def get_cluster_member_resources(self, member_name: Any) -> MemberResources:
        raw = self.state().raw
        if raw is None:
            return member_resources(self.node(member_name))
        return _given(raw["member_resources"], "member_resources", member_name)

    def get_instance_resources(self) -> InstanceResources | JSONObject:
        raw = self.state().raw
        if raw is not None:
            return raw["instance_resources"] or {}
        return instance_resources(self.state().needs)


class _StarlarkPolicy:
    _program: ClassVar[_Program]

    def __init__(self, rule_id: str, settings: JSONObject, parameters: JSONObject):
        self.rule_id = rule_id
        self.settings = settings or {}
        self.parameters = parameters or {}
        #: (level, message) lines logged by the last call (also after a failed call)
        self.logs: list[tuple[str, str]] = []
        self._host = _Host(self._program.name, str(rule_id))
        self._module = self._instantiate()

    # the module: predeclared globals + host functions, top level run once, then frozen
    def _instantiate(self) -> Any:
        prog, host = self._program, self._host
        mod = sl.Module()
        try:
            mod["settings"] = self.settings
            mod["rule_id"] = str(self.rule_id)
            mod["init_parameters"] = self.parameters
        except (TypeError, ValueError, OverflowError) as exc:
            raise StarlarkError(f"{prog.name}: settings/parameters are not convertible to Starlark: {exc}") from None
        for level, fname in zip(("info", "warn", "error"), LOG_FUNCS, strict=True):
            mod.add_callable(fname, host.logger(level))
        if prog.form == LXD_FORM:
            for fname in LXD_FUNCS:
                mod.add_callable(fname, getattr(host, fname))
        state = self._begin()
        try:
            opts = sl.EvalOptions(check_cancelled=state.cancelled, max_callstack_size=prog.limits.callstack())
            sl.eval_with(opts, mod, prog.ast, _GLOBALS)
        except BaseException as exc:
            raise self._convert(exc, state, "top level failed") from None
        finally:
            self._end(state)
        return mod.freeze()

    def _begin(self) -> _CallState:
        state = _CallState(self._program.limits.timeout_s)
        self._host.tls.state = state
        return state

    def _end(self, state: _CallState) -> None:
        self._host.tls.state = None
        if state.dropped:
            state.logs.append(("warn", f"({state.dropped} more log lines dropped)"))
        self.logs = state.logs

    def _call(self, state: _CallState, fn: str, *args: Any) -> Any:
        prog = self._program
        opts = sl.EvalOptions(check_cancelled=state.cancelled, max_callstack_size=prog.limits.callstack())
        label = args[0] if fn == _WRAPPER else fn
        try:
            return self._module.call_with(opts, fn, *args).value
        except BaseException as exc:
            raise self._convert(exc, state, f"{label}() failed") from None

    def _convert(self, exc: BaseException, state: _CallState, what: str) -> StarlarkError:
        prog = self._program
        if isinstance(exc, StarlarkError):
            return exc
        if state.timed_out:
            return _from_starlark(exc, prog.name, f"{what}: time limit exceeded ({prog.limits.timeout_s:g}s)")
        if isinstance(exc, sl.StarlarkError):
            text = str(exc)
            if "call stack overflow" in text:
                return _from_starlark(
                    exc, prog.name, f"{what}: call stack limit ({prog.limits.callstack()} frames) exceeded, deep recursion?"
                )
            if "serde::serialize" in text:
                return _from_starlark(exc, prog.name, f"{what}: the value it returned is not convertible to Python")
            return _from_starlark(exc, prog.name, what)
        if isinstance(exc, TypeError | ValueError | OverflowError | MemoryError | RecursionError):
            return StarlarkError(f"{prog.name}: {what}: value conversion failed: {type(exc).__name__}: {exc}")
        if type(exc).__name__ == "PanicException":  # pyo3 turns a Rust panic into a BaseException
            return StarlarkError(f"{prog.name}: {what}: interpreter panic: {exc}")
        raise exc


class _SeedPolicy(_StarlarkPolicy):
    """``def eval(parameters, input_data, context)``; context changes are copied back."""

    def eval(self, parameters: Any, input_data: Any, context: JSONObject | None) -> Any:
        state = self._begin()
        try:
            ctx_in = dict(context) if context is not None else {}
            result, ctx_out = self._call(state, _WRAPPER, "eval", parameters, input_data, ctx_in)
        finally:
            self._end(state)
        if context is not None and isinstance(ctx_out, dict):
            for key in [k for k in context if k not in ctx_out]:
                del context[key]
            for key, value in ctx_out.items():
                if key not in context or context[key] != value:
                    context[key] = value
        return result


class _PlacementPolicy(_StarlarkPolicy):
    """``def instance_placement(request, candidate_members)`` as a resourceAllocator."""

    @property
    def share(self) -> bool:
        return bool(self.settings.get("gpuSharing", False))

    def eval(self, parameters: Any, input_data: PolicyInput, context: Any) -> Placement | DryRunAnswer | None:
        name = self._program.name
        action = input_data.get("action")
        if action == "scale_down":
            return None  # a placement scriptlet does not choose removals: the framework's default
        if action not in ("dry_run", "allocation", "scale", "reassignment"):
            raise StarlarkError(f"{name}: an instance_placement scriptlet cannot serve action {action!r}")
        payload: PlacementPayload = input_data.get("payload") or PlacementPayload()
        block = payload.get("block") or {}
        needs: Needs = block.get("resources") or Needs()
        nodes: dict[str, NodeView] = (payload.get("cluster_metrics") or {}).get("nodes") or {}
        healthy = set(payload.get("healthy_nodes") or [nid for nid, n in nodes.items() if n.get("healthy")])
        state = self._begin()
        state.needs = needs
        state.all_nodes = nodes
        state.nodes = capacity.copy_nodes({nid: n for nid, n in nodes.items() if nid in healthy})
        try:
            if action == "dry_run":
                return self._dry_run(state, block, payload)
            avoid: set[str] = set()
            if action == "reassignment":
                current = (block.get("instances") or {}).get(payload.get("instance_id", ""), {}) or {}
                if current.get("node"):
                    avoid.add(current["node"])
            req = placement_request(block, payload, action)
            outcome = self._place(state, req, avoid)
            if outcome is None:
                raise StarlarkError(f"{name}: no healthy node can host an instance needing {_fmt(needs)} (no candidate members)")
            target, gpus, rejected = outcome
            if rejected is not None:
                raise StarlarkError(f"{name}: placement rejected: {rejected}")
            return {"node_id": target, "gpus": gpus}
        finally:
            self._end(state)

    def _dry_run(self, state: _CallState, block: PolicyBlock, payload: PlacementPayload) -> DryRunAnswer:
        want = max(int(block.get("maxInstances") or 1), 1)
        bid = str(block.get("blockId", "block"))
        first: Placement = {}
        placed = 0
        for i in range(want):
            req = placement_request(block, {**payload, "pod_name": f"{bid}-{i}"}, "dry_run")
            outcome = self._place(state, req, set())
            if outcome is None:
                break
            target, gpus, rejected = outcome
            if rejected is not None:
                if placed == 0:
                    raise StarlarkError(f"{self._program.name}: placement rejected: {rejected}")
                break
            capacity.take(state.nodes[target], gpus, state.needs, self.share)
            if not first:
                first = {"node_id": target, "gpus": gpus}
            placed += 1
        return {"selection_score_data": {"score": placed / want, "node_info": first}}

    def _place(self, state: _CallState, req: PlacementRequest, avoid: set[str]) -> tuple[str, list[str], str | None] | None:
        """One scriptlet call. None if there is no candidate; else (target, gpus, rejection)."""
        fits = self._candidates(state, avoid) or (self._candidates(state, set()) if avoid else {})
        if not fits:
            return None
        state.members = {nid: cluster_member(state.nodes[nid]) for nid in fits}
        state.target = None
        ret = self._call(state, LXD_FORM, req, list(state.members.values()))
        if ret is not None:
            return "", [], ret if isinstance(ret, str) else _star_repr(ret)
        if state.target is None:
            raise StarlarkError(
                f"{self._program.name}: instance_placement returned without calling set_target(member_name) "
                f"(candidates: {', '.join(state.members)})"
            )
        return state.target, fits[state.target], None

    def _candidates(self, state: _CallState, avoid: set[str]) -> dict[str, list[str]]:
        """Healthy nodes that can host one instance -> the GPU ids the picker would give it."""
        out: dict[str, list[str]] = {}
        count = int(state.needs.get("gpus", 0))
        for nid in sorted(state.nodes):
            node = state.nodes[nid]
            if nid in avoid:
                continue
            aff = node.get("affinity") or {}
            if not aff.get("pass", True):
                continue
            usable = capacity.node_fits(node, state.needs, self.share)
            if usable is None:
                continue
            require = set(aff.get("require_gpus", []))
            if require and not require <= {g["id"] for g in usable}:
                continue
            gpus = pick_gpus(usable, count, aff)
            if len(gpus) < count:
                continue
            out[nid] = gpus
        return out


def _star_repr(v: Any) -> str:
    """A Starlark-looking rendering of a converted value (for log lines and rejections)."""
    if v is None:
        return "None"
    if isinstance(v, bool):
        return "True" if v else "False"
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_star_repr(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_star_repr(k)}: {_star_repr(x)}" for k, x in v.items()) + "}"
    return str(v)


def _fmt(needs: Needs) -> str:
    return (
        f"{needs.get('gpus', 0)} GPU(s) x {needs.get('gpuMemory', 0)} MiB, "
        f"{needs.get('cpu', 0)} CPU, {needs.get('memory', 0)} MiB"
    )


def run_lxd(source: str, name: str, args: LxdArgs, limits: Limits | None = None) -> LxdOutcome:
    """Run an LXD ``instance_placement`` scriptlet on LXD's own arguments:
    ``{"request": {...}, "candidate_members": [...]}`` plus, optionally, ``member_state`` and
    ``member_resources`` (member name -> what the helpers return) and ``instance_resources``.
    Returns ``{"target": name, "logs": [[level, text], ...]}``; a rejection or an error raises
    :class:`StarlarkError` (the rejection message included)."""
    cls = compile_policy(source, name, limits)
    if cls._program.form != LXD_FORM:
        raise StarlarkError(f"{name}: not an LXD scriptlet (no instance_placement(request, candidate_members))")
    inst = cls("policy-run", {}, {})
    members = {m["server_name"]: m for m in args.get("candidate_members", [])}
    state = inst._begin()
    state.members = members
    state.raw = {"member_state": args.get("member_state"), "member_resources": args.get("member_resources"),
                 "instance_resources": args.get("instance_resources")}
    try:
        ret = inst._call(state, LXD_FORM, args.get("request", {}), list(members.values()))
    finally:
        inst._end(state)
    if ret is not None:
        raise StarlarkError(f"{name}: placement rejected: {ret}")
    if state.target is None:
        raise StarlarkError(f"{name}: instance_placement returned without calling set_target(member_name)")
    return {"target": state.target, "logs": [list(line) for line in inst.logs]}
