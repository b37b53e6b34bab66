"""The ``policy`` commands: ``run`` (one call, no servers), ``add``, ``test`` (recorded decisions
against a candidate), ``input`` (a recorded call's input), ``list``, ``show``."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import typer
from rich.markup import escape

from .common import (
    DataDir,
    _json_option,
    _read_object,
    _request,
    _run,
    _seconds,
    _with_client,
    _with_store,
    console,
    err,
)
from .render import _plain, _table

if TYPE_CHECKING:
    from ..handlers.policy_test import Report
    from ..schemas.lxd import LxdArgs
    from ..schemas.records import JSONObject, ReplayedDecision
    from .client import Client

def policy_run(
    file_or_uri: str = typer.Argument(..., help="A .py or .star file, builtin:NAME or module:Class."),
    input_file: Path = typer.Option(..., "--input", "-i", help='JSON: {"action": ..., ...} as the seed defines; for --kind lxd, {"request", "candidate_members", ...}.'),
    kind: str = typer.Option("resourceAllocator", help="clusterAllocator | resourceAllocator | lxd (an LXD instance_placement scriptlet)"),
    parameters: str = typer.Option("{}", help="JSON parameters."),
    settings: str = typer.Option("{}", help="JSON settings."),
) -> None:
    """Run one policy once with the seed's interface and print its result as JSON (no servers).
    With `--kind lxd`, run an LXD placement scriptlet on LXD's own arguments (optionally with
    `member_state` / `member_resources` / `instance_resources` for the helpers) and print the
    chosen target; a rejection exits 1 with the scriptlet's message. A policy that fails exits 1;
    problems with the arguments (the policy, --kind, --input, --parameters, --settings) are all
    listed at once, before anything runs, and exit 2.

    Example: `blocks policy run my_policy.py --kind clusterAllocator --input selection.json`,
    `blocks policy run placement.star --kind lxd --input lxd_args.json`
    """
    from ..policies.runtime import PolicyRuntime
    from ..schemas.errors import PolicyFailed

    problems, input_data, options = _run_arguments(file_or_uri, kind, input_file, parameters, settings)
    for problem in problems:  # every one at once: nothing has run
        err.print(f"[red]error:[/] {escape(problem)}", highlight=False, soft_wrap=True)
    if problems:
        raise typer.Exit(2)
    if kind == "lxd":
        from ..policies.starlark_runtime import StarlarkError, run_lxd

        try:
            out = run_lxd(Path(file_or_uri).read_text(), Path(file_or_uri).stem, cast("LxdArgs", input_data))
        except (OSError, StarlarkError) as exc:
            err.print(f"[red]{exc}[/]")
            raise typer.Exit(1)
        for level, text in out["logs"]:
            err.print(f"[dim][{level}][/] {text}")
        print(json.dumps({"target": out["target"]}))
        return
    rule = {"name": kind, "policyRuleURI": file_or_uri, **options}
    # one call: one sandbox process, its own (the worker's shared pool starts all of
    # AIOS_PYTHON_POLICY_PROCESSES at its first call), stopped when the call is done
    runtime = PolicyRuntime(allow_files=True, processes=1)
    trace: dict[str, Any] = {}
    try:
        result = _run(runtime.invoke(rule, f"cli.{kind}", input_data, {}, trace))
    except PolicyFailed as exc:
        err.print(f"[red]{escape(str(exc))}[/]", highlight=False, soft_wrap=True)
        raise typer.Exit(1)
    finally:  # what the policy printed (or logged): stderr, so stdout stays the result's JSON
        runtime.close()
        for level, text in trace.get("logs") or ():
            err.print(f"[dim]\\[{escape(level)}][/] {escape(text)}", highlight=False, soft_wrap=True)
    print(json.dumps(result, indent=2, default=str))


def _run_arguments(uri: str, kind: str, input_file: Path, parameters: str, settings: str
                   ) -> tuple[list[str], JSONObject, dict[str, JSONObject]]:
    """``policy run``'s arguments read and checked: (every problem, the input, the rule's
    ``parameters`` and ``settings``)."""
    from ..schemas.spec import POLICY_KINDS

    problems: list[str] = []
    kinds = (*POLICY_KINDS, "lxd")
    if kind not in kinds:
        problems.append(f"--kind {kind!r}: expected one of {', '.join(kinds)}")
    policy = _policy_problem(uri, kind if kind in kinds else None)
    if policy:
        problems.append(policy)
    input_data, unreadable = _read_object(input_file)
    if unreadable:
        problems.append(unreadable)
    options: dict[str, JSONObject] = {}
    for name, text in (("parameters", parameters), ("settings", settings)):
        try:
            options[name] = _json_option(text, f"--{name}")
        except typer.BadParameter as exc:
            problems.append(exc.format_message())
    return problems, input_data, options


def _policy_problem(uri: str, kind: str | None) -> str | None:
    """Why ``policy run`` cannot run ``uri`` as a ``kind`` policy (None: it may; a module that is
    there but fails to load, or a source that does not compile, says so when it loads)."""
    import importlib.util

    from ..schemas.uris import uri_problem

    if kind == "lxd" and not uri.endswith(".star"):
        return f"--kind lxd runs an LXD placement scriptlet, a .star file, not {uri!r}"
    if uri.startswith("registry:"):
        name = uri.removeprefix("registry:").partition("@")[0]
        return (f"{uri}: `blocks policy run` runs a file and needs no servers, so it reads no registry; "
                f"save the source (`blocks policy show {name}`) as {name}.py (or .star) and run that")
    if uri.endswith((".py", ".star")):
        return None if Path(uri).is_file() else f"no policy file {uri} (expected a .py or .star file, builtin:NAME or module:Class)"
    problem = uri_problem(uri, None if kind == "lxd" else kind)
    if problem is None and not uri.startswith("builtin:"):  # module:Class
        module = uri.partition(":")[0]
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a parent package that is not there
            found = False
        if not found:
            return f"{uri}: no module named {module!r} (module:Class names an importable class)"
    return problem


def policy_add(name: str, file: Path, data_dir: Path = DataDir) -> None:
    """Store a policy (Python `.py`, trusted; Starlark `.star`, sandboxed) in the registry as a new
    version and tell workers; blocks use it as `registry:NAME` (their IR pins the version) or
    `registry:NAME@VERSION`. A block naming a policy or version not stored is rejected at its parse.

    Example: `blocks policy add my-packer my_packer.py`, `blocks policy add lxd-mem most_free.star`
    """
    from ..policies.runtime import compile_source, language_of

    source = file.read_text()
    language = language_of(str(file))
    try:
        compile_source(source, language, str(file))
    except Exception as exc:
        err.print(f"[red]{file} does not load: {type(exc).__name__}: {exc}[/]")
        raise typer.Exit(1)

    async def go(c: Client) -> int:
        return await c.policy_put(name, source, language)  # the policy.updated event tells workers

    version = _request(go, data_dir)
    console.print(f"policy [bold]{name}[/] version {version} stored; use policyRuleURI: registry:{name}")


def policy_test(
    name: str = typer.Argument(..., help="Policy whose recorded decisions to re-run: a registry name, a policy rule name (resourceAllocator) or a policyRuleURI."),
    file: Path = typer.Argument(..., help="Candidate version (.py)."),
    since: str = typer.Option(None, help="Only decisions newer than this: seconds, or 30m / 2h / 1d."),
    blocks_: int = typer.Option(0, "--blocks", help="Only the N most recent blocks (0 = all)."),
    as_json: bool = typer.Option(False, "--json"),
    data_dir: Path = DataDir,
) -> None:
    """Re-run recorded decisions of past blocks against a candidate policy version, offline, and
    print what would have changed (different cluster/node, newly failing, newly feasible).
    Preemption decisions (action preempt) are replayed from their recorded input and compared
    byte for byte with the recorded output.

    Example: `blocks policy test my-packer my_packer_v2.py --since 2h --blocks 50`
    """
    from ..handlers.policy_test import compare
    from ..policies.runtime import PolicyRuntime

    cutoff = time.time() - _seconds(since, "--since") if since else None
    runtime = PolicyRuntime(allow_files=True)

    async def go(c: Client) -> Report:
        recorded = [
            d for d in await c.decisions(cutoff)
            if name in (d.get("policy"), d.get("uri"), d.get("kind"), d.get("uri", "").removeprefix("registry:"))
        ]
        if blocks_:
            keep = list(dict.fromkeys(d["block_id"] for d in reversed(recorded)))[:blocks_]
            recorded = [d for d in recorded if d["block_id"] in set(keep)]

        async def run(input_data: JSONObject) -> Any:
            rule = {"name": name, "policyRuleURI": str(file), "parameters": {}, "settings": {}}
            return await runtime.invoke(rule, f"policy-test.{name}", input_data, {})

        return await compare(recorded, run)

    report = _run(_with_client(data_dir, go))
    if as_json:
        print(json.dumps(report, indent=2, default=str))
        return
    c = report["counts"]
    console.print(
        f"{report['total']} recorded decisions of [bold]{name}[/]: {c['same']} same, [yellow]{c['changed']} changed[/], "
        f"[red]{c['newly_failing']} newly failing[/], [green]{c['newly_feasible']} newly feasible[/], {c['skipped']} without input"
    )
    if report["replays"]:
        console.print(f"{len(report['replays'])} preemption decision(s) replayed byte for byte: "
                      f"{report['identical']} identical output(s)")
        for r in report["replays"]:
            mark = "identical" if r["identical"] else f"[red]differs[/] (recorded {r['recorded_sha256']})"
            console.print(f"  {r['block_id']}: {r['bytes']} bytes, sha256 {r['replayed_sha256']}: {mark}")
    if report["changes"]:
        t = _table("block", "action", "recorded", "candidate", "verdict")
        for row in report["changes"]:
            t.add_row(*_plain(row["block_id"], row["action"], row["before"], row["after"], row["verdict"]))
        console.print(t)


def policy_input(
    bid: str = typer.Argument(..., help="Block whose recorded policy call to dump."),
    step: str = typer.Option("allocation", "--step", help="The call's action: selection, dry_run, post_dry_run, allocation, scale, scale_down, reassignment."),
    index: int = typer.Option(-1, "--index", help="Which call of that step, oldest first (0, 1, ...; -1 = the last)."),
    output: Path = typer.Option(None, "--output", "-o", help="Write the input here instead of stdout."),
    data_dir: Path = DataDir,
) -> None:
    """Dump the exact input a block's policy got at one step (from its recorded decision), ready
    for `blocks policy run FILE --input`: replay a real placement against your own policy offline.

    Example: `blocks policy input BID --step allocation -o input.json`,
    then `blocks policy run examples/first_fit.py --input input.json`
    """

    async def go(c: Client) -> list[ReplayedDecision]:
        return await c.decisions(bid=bid)

    recorded = _run(_with_client(data_dir, go))
    calls = [d for d in recorded if d.get("action") == step]
    if not calls:
        steps = sorted({str(d.get("action")) for d in recorded})
        where = f"its recorded steps: {', '.join(steps)}" if steps else "no policy call is recorded for it"
        err.print(f"[red]block {bid} has no recorded {step!r} policy call[/] ({where})")
        raise typer.Exit(1)
    if not -len(calls) <= index < len(calls):
        err.print(f"[red]--index {index} out of range[/]: block {bid} has {len(calls)} recorded {step!r} call(s)")
        raise typer.Exit(2)
    call = calls[index]
    if call.get("input") is None:
        err.print(f"[red]the input of that call could not be rebuilt by replay[/] ({call.get('input_check')}, digest {call.get('input_digest')})")
        raise typer.Exit(1)
    text = json.dumps(call["input"], indent=2, default=str)
    if output is None:
        print(text)
        return
    output.write_text(text + "\n")
    err.print(f"wrote {output}: the {step} input of {call.get('kind')} ({call.get('uri')}), call {index if index >= 0 else len(calls) + index} of {len(calls)}")


def policy_list(data_dir: Path = DataDir) -> None:
    """List registry policies. Example: `blocks policy list`"""

    async def go(c: Client) -> None:
        t = _table("name", "version", "language")
        for name in await c.store.policy_names():
            rec = await c.store.policy_get(name)
            t.add_row(*_plain(name, rec.get("version", "") if rec else "", rec.get("language", "") if rec else ""))
        console.print(t)

    _run(_with_store(data_dir, go))


def policy_show(name: str, version: int = typer.Option(None), data_dir: Path = DataDir) -> None:
    """Print a registry policy's source. Example: `blocks policy show my-packer --version 2`"""
    rec = _run(_with_store(data_dir, lambda c: c.store.policy_get(name, version)))
    if rec is None:
        err.print(f"[red]no policy {name}[/]")
        raise typer.Exit(1)
    console.print(escape(f"# {name} v{rec['version']} ({rec.get('language')})"))
    print(rec["source"])
