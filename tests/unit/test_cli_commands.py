"""The CLI's own decisions, through its public commands (typer's CliRunner over ``cli.main.app``),
where no servers are needed: bad arguments get one clear line and exit 2 before anything is sent
or looked for, no running servers is said as such, and the offline commands (``policy run``,
``settings``, ``subjects``, ``asyncapi``, ``examples``, ``prometheus-config``) print what they
promise."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from aios_blocks.cli.main import app

EXAMPLES = Path(__file__).resolve().parents[2] / "src" / "aios_blocks" / "examples"


def _one_line(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize("args", [["get", "blk-1"], ["list"], ["delete", "blk-1"], ["cluster", "list"], ["policy", "list"]])
def test_without_servers_a_command_says_so_and_exits_2(cli: CliRunner, args: list[str]) -> None:
    r = cli.invoke(app, args)
    assert r.exit_code == 2, r.output
    assert "No servers. No running `blocks up` found in" in _one_line(r.output)
    assert "(no endpoints.json)" in r.output and "AIOS_NATS_URL" in r.output


@pytest.mark.parametrize("args", [["observer", "add", "grafana"], ["observer", "remove", "grafana"], ["observer", "list"],
                                  ["tenant", "add", "team-a"], ["tenant", "remove", "team-a"], ["tenant", "list"],
                                  ["tenant", "user", "add", "team-a", "dash"], ["tenant", "user", "remove", "team-a", "dash"]])
def test_the_commands_that_change_nats_users_say_no_servers_too(cli: CliRunner, args: list[str]) -> None:
    """``blocks observer`` / ``blocks tenant`` change the running server's users: without one they
    say so in one line and exit 2, as every command does (they raised a RuntimeError's traceback, and
    the lists printed a bare path: ``error: .../auth/secrets.json``)."""
    r = cli.invoke(app, args)
    assert r.exit_code == 2, r.output
    assert "No servers. No running `blocks up` found in" in _one_line(r.output), r.output


def test_an_observer_added_to_a_blocks_up_no_longer_running_is_refused_in_one_line(cli: CliRunner, tmp_path: Path) -> None:
    data = tmp_path / "data"
    (data / "auth").mkdir(parents=True)
    (data / "auth" / "secrets.json").write_text("{}")
    (data / "endpoints.json").write_text(json.dumps({"nats": "nats://127.0.0.1:9", "redis": "redis://127.0.0.1:9/0", "auth": True}))
    r = cli.invoke(app, ["observer", "add", "grafana"])
    assert r.exit_code == 2 and "is left from a `blocks up` that is no longer running" in _one_line(r.output), r.output
    r = cli.invoke(app, ["observer", "list", "--json"])  # the list reads the data dir only
    assert r.exit_code == 0 and json.loads(r.stdout) == [], r.output


@pytest.mark.parametrize("args", [["task", "a{b}"], ["top", "a{b}"]])
def test_an_invalid_block_id_is_refused_before_anything_is_sent(cli: CliRunner, args: list[str]) -> None:
    r = cli.invoke(app, args, input="")
    assert r.exit_code == 2 and "block id 'a{b}' is not a valid id" in _one_line(r.output), r.output
    assert "No servers" not in r.output


def test_a_negative_scale_target_is_a_usage_error_even_without_servers(cli: CliRunner) -> None:
    r = cli.invoke(app, ["scale", "blk-1", "--to", "-1"])
    assert r.exit_code == 2 and "target must be a count of instances >= 0, got -1" in r.output, r.output
    assert "No servers" not in r.output


@pytest.mark.parametrize("value", ["0", "-3", "nan", "inf"])
def test_a_timeout_must_be_a_finite_positive_number_of_seconds(cli: CliRunner, value: str) -> None:
    r = cli.invoke(app, ["delete", "blk-1", "--timeout", value])
    assert r.exit_code == 2 and "expected seconds > 0" in _one_line(r.output), r.output


def test_a_label_must_be_key_equals_value(cli: CliRunner) -> None:
    r = cli.invoke(app, ["cluster", "add", "c1", "--label", "novalue"])
    assert r.exit_code == 2 and "expected key=value, got 'novalue'" in _one_line(r.output), r.output


def test_a_spec_file_that_cannot_be_read_is_named(cli: CliRunner, tmp_path: Path) -> None:
    r = cli.invoke(app, ["submit", str(tmp_path / "missing.yaml")])
    assert r.exit_code != 0 and f"cannot read {tmp_path / 'missing.yaml'}" in _one_line(r.output), r.output


# -- offline commands -------------------------------------------------------------------------------
def test_policy_run_answers_with_the_policys_result(cli: CliRunner, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIOS_STARLARK_CALL_TIMEOUT_S", "120")  # the answer is checked, not the time (a loaded box)
    r = cli.invoke(app, ["policy", "run", "builtin:binpack", "--input", str(EXAMPLES / "allocation_input.json")])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert set(out) == {"node_id", "gpus"} and out["node_id"] and len(out["gpus"]) == 1
    # the same with the Starlark example of the same rule
    r = cli.invoke(app, ["policy", "run", str(EXAMPLES / "binpack.star"), "--input", str(EXAMPLES / "allocation_input.json")])
    assert r.exit_code == 0 and json.loads(r.stdout)["node_id"] == out["node_id"], r.output


def test_policy_run_keeps_stdout_the_result_when_the_policy_prints(cli: CliRunner, tmp_path: Path) -> None:
    # seed 000's clusterAllocator example prints its arguments; `blocks policy run ... | jq` must
    # still read the result: the printed lines go to stderr
    selector = Path(__file__).parent / "seed_policies" / "cluster_selector.py"
    inp = tmp_path / "selection.json"
    inp.write_text(json.dumps({"action": "selection", "filter_result": [{"cluster_id": "c1", "id": "c1", "labels": {}}]}))
    r = cli.invoke(app, ["policy", "run", str(selector), "--kind", "clusterAllocator", "--input", str(inp)])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout) == {"clusters": [{"cluster_id": "c1", "id": "c1", "labels": {}}]}
    assert "[print] {} {'action': 'selection'" in r.stderr


def test_policy_run_of_an_lxd_scriptlet_prints_its_target(cli: CliRunner) -> None:
    r = cli.invoke(app, ["policy", "run", str(EXAMPLES / "lxd_most_free_memory.star"), "--kind", "lxd",
                         "--input", str(EXAMPLES / "lxd_args.json")])
    assert r.exit_code == 0, r.output
    assert set(json.loads(r.stdout)) == {"target"}


def test_policy_run_refuses_bad_parameters_and_a_policy_that_fails(cli: CliRunner, tmp_path: Path) -> None:
    args = ["policy", "run", "builtin:binpack", "--input", str(EXAMPLES / "allocation_input.json")]
    r = cli.invoke(app, [*args, "--parameters", "{bad"])
    assert r.exit_code == 2 and "Invalid value for --parameters: not JSON" in _one_line(r.output), r.output
    broken = tmp_path / "broken.py"
    broken.write_text("class P:\n    def __init__(self, r, s, p):\n        pass\n    def eval(self, p, i, c):\n        raise RuntimeError('no idea')\n")
    r = cli.invoke(app, ["policy", "run", str(broken), "--input", str(EXAMPLES / "allocation_input.json")])
    assert r.exit_code != 0 and "raised RuntimeError: no idea" in _one_line(r.output), r.output


@pytest.mark.parametrize("policy", ["first_fit.py", "binpack.star"])
def test_policy_run_starts_one_sandbox_process_and_stops_it(cli: CliRunner, monkeypatch: pytest.MonkeyPatch, policy: str) -> None:
    # one call needs one process: it started the worker's shared pool, all of
    # AIOS_PYTHON_POLICY_PROCESSES (4; Starlark's 2) at its first call, and left them running
    from aios_blocks.policies import sandbox

    monkeypatch.setattr(sandbox, "_shared", {})  # no shared pool started yet (as in a fresh `blocks`)
    slots: list[sandbox._Slot] = []
    real = sandbox._Slot.__init__

    def counted(self: sandbox._Slot, *args: object) -> None:
        real(self, *args)  # type: ignore[arg-type]
        slots.append(self)

    monkeypatch.setattr(sandbox._Slot, "__init__", counted)
    try:
        r = cli.invoke(app, ["policy", "run", str(EXAMPLES / policy), "--input", str(EXAMPLES / "allocation_input.json")])
    finally:
        for pool in sandbox._shared.values():
            pool.close()
    assert r.exit_code == 0 and json.loads(r.stdout)["node_id"], r.output
    assert len(slots) == 1, f"{len(slots)} policy processes for one call"
    assert slots[0].procs
    for _ in range(100):  # killed; the executor's manager thread may be reaping it this moment
        if not any(p.is_alive() for p in slots[0].procs):
            break
        time.sleep(0.05)
    assert not any(p.is_alive() for p in slots[0].procs), slots[0].procs


def test_policy_run_lists_every_problem_of_its_arguments_at_once(cli: CliRunner, tmp_path: Path) -> None:
    # a policy file that is not there read as "no policy registry available" (exit 1), and only
    # after the input's problem had stopped the command; --kind was not checked at all
    r = cli.invoke(app, ["policy", "run", str(tmp_path / "nope.py"), "--kind", "bogus", "--input", str(tmp_path / "in.json"),
                         "--parameters", "{bad", "--settings", "[1]"])
    lines = [_one_line(line) for line in r.stderr.splitlines() if line.strip()]
    assert r.exit_code == 2 and len(lines) == 5, r.output
    assert lines[0].startswith("error: --kind 'bogus': expected one of clusterAllocator, resourceAllocator,"), lines
    assert lines[1] == f"error: no policy file {tmp_path / 'nope.py'} (expected a .py or .star file, builtin:NAME or module:Class)"
    assert lines[2].startswith(f"error: cannot read {tmp_path / 'in.json'}: "), lines
    assert lines[3].startswith("error: Invalid value for --parameters: not JSON"), lines
    assert lines[4] == "error: Invalid value for --settings: expected a JSON object"


@pytest.mark.parametrize(("policy", "kind", "says"), [
    ("registry:my-packer", "resourceAllocator", "registry:my-packer: `blocks policy run` runs a file and needs no servers, "
                                                "so it reads no registry; save the source (`blocks policy show my-packer`)"),
    ("builtin:nosuch", "resourceAllocator", "unknown built-in policy 'builtin:nosuch'; the built-ins are builtin:best-fit,"),
    ("builtin:cluster-rank", "resourceAllocator", "builtin:cluster-rank is a clusterAllocator policy, not a resourceAllocator one"),
    ("nosuch_module:Policy", "resourceAllocator", "nosuch_module:Policy: no module named 'nosuch_module'"),
    ("first_fit.py", "lxd", "--kind lxd runs an LXD placement scriptlet, a .star file, not "),
    ("nope.star", "lxd", "no policy file nope.star"),
])
def test_policy_run_names_a_policy_it_cannot_run(cli: CliRunner, policy: str, kind: str, says: str) -> None:
    path = str(EXAMPLES / policy) if policy == "first_fit.py" else policy
    r = cli.invoke(app, ["policy", "run", path, "--kind", kind, "--input", str(EXAMPLES / "allocation_input.json")])
    lines = [_one_line(line) for line in r.stderr.splitlines() if line.strip()]
    assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith(f"error: {says}"), r.output


def test_settings_lists_every_setting_with_its_default(cli: CliRunner) -> None:
    from aios_blocks.settings import Settings

    r = cli.invoke(app, ["settings"])
    assert r.exit_code == 0, r.output
    for name in ("AIOS_DRY_RUN_DEADLINE_S", "AIOS_DRAIN_GRACE_S", "AIOS_METRICS_INTERVAL_S"):
        assert name in r.output
    assert len([n for n in Settings.model_fields if f"AIOS_{n.upper()}" in r.output]) == len(Settings.model_fields)


def test_asyncapi_prints_the_document(cli: CliRunner) -> None:
    from aios_blocks.bus import catalog

    r = cli.invoke(app, ["asyncapi"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["asyncapi"] == "3.0.0"
    # a channel per catalog event, with its address; and the replies (channels without one: the
    # requester's inbox) of the events that are answered, as a task is (docs/subjects.md)
    addressed = {k for k, c in doc["channels"].items() if c.get("address")}
    assert addressed == {e.name.replace(".", "_") for e in catalog.EVENTS}
    assert set(doc["channels"]) - addressed == {"block_task_reply", "tenant_block_task_reply"}


def test_subjects_lists_every_event_of_the_catalog(cli: CliRunner) -> None:
    from aios_blocks.bus import catalog

    r = cli.invoke(app, ["subjects", "--markdown"])  # docs/subjects.md's table
    assert r.exit_code == 0, r.output
    missing = [e.pattern for e in catalog.EVENTS if e.pattern not in r.stdout]
    assert missing == [] and r.stdout.count("\n| `aios.") >= len(catalog.EVENTS)


def test_examples_lists_the_shipped_files(cli: CliRunner) -> None:
    r = cli.invoke(app, ["examples"])
    assert r.exit_code == 0, r.output
    for name in ("allocation_input.json", "binpack.star", "block.yaml", "first_fit.py"):
        assert name in r.output


def test_prometheus_config_without_servers_says_so(cli: CliRunner) -> None:
    r = cli.invoke(app, ["prometheus-config"])
    assert "No servers" in r.output, r.output


def test_an_unknown_agent_runtime_is_a_usage_error_before_it_connects(cli: CliRunner) -> None:
    # it connected first (adding the node's user to a running blocks up), then "agent failed: unknown
    # runtime 'nope'", exit 1
    r = cli.invoke(app, ["agent", "--node-id", "n1", "--cluster", "c1", "--runtime", "nope"])
    assert r.exit_code == 2 and "'nope' is no runtime: docker, process, sim" in _one_line(r.output), r.output
    assert "No NATS" not in r.output


def test_an_agents_instance_directories_are_under_its_data_dir(cli: CliRunner, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # they were in ./.aios-data/agent wherever the agent started, whatever its --data-dir: a stray
    # .aios-data there, and two systems' agents started from one directory shared a process scope
    from aios_blocks.agent import main as agent_main
    from aios_blocks.runtime import embedded

    got: list[object] = []

    async def run_agent(opts: object, url: str, stop: object) -> None:
        got.append(opts)

    monkeypatch.setattr(embedded, "agent_nats_url", lambda data_dir, nid: "nats://127.0.0.1:4222")
    monkeypatch.setattr(agent_main, "run_agent", run_agent)
    monkeypatch.chdir(tmp_path)
    for extra, where in (([], tmp_path / "data" / "agent"), (["--data-dir", str(tmp_path / "d2")], tmp_path / "d2" / "agent"),
                         (["--agent-dir", str(tmp_path / "own")], tmp_path / "own")):
        r = cli.invoke(app, ["agent", "--node-id", "n1", "--cluster", "c1", "--runtime", "sim", *extra])
        assert r.exit_code == 0, r.output
        assert got.pop().data_dir == where, extra  # type: ignore[attr-defined]
    assert not (tmp_path / ".aios-data").exists()


def test_an_agent_that_loses_its_servers_says_so_once_with_exit_2(cli: CliRunner, monkeypatch: pytest.MonkeyPatch) -> None:
    # _run's 'Cannot reach the servers' (exit 2) was caught as any error: a second line 'agent
    # failed: 2' and exit 1 (tests/integration/test_agent_stop.py: the real agent on a real server)
    from aios_blocks.agent import main as agent_main
    from aios_blocks.runtime import embedded

    async def run_agent(opts: object, url: str, stop: object) -> None:
        raise ConnectionResetError("Connection lost")

    monkeypatch.setattr(embedded, "agent_nats_url", lambda data_dir, nid: "nats://127.0.0.1:4222")
    monkeypatch.setattr(agent_main, "run_agent", run_agent)
    r = cli.invoke(app, ["agent", "--node-id", "n1", "--cluster", "c1", "--runtime", "sim"])
    assert r.exit_code == 2, r.output
    assert "Cannot reach the servers: Connection lost" in _one_line(r.output) and "agent failed" not in r.output, r.output


@pytest.mark.parametrize(("secrets", "says"), [
    (None, "auth/secrets.json does not exist"),
    ('{"nats": {', "auth/secrets.json is not JSON (Expecting property name enclosed in double quotes at line 1 column 11)"),
    ("[]", "auth/secrets.json does not hold a JSON object"),  # was a TypeError traceback
    ('{"nats": {}, "redis": {}}', "auth/secrets.json has no NATS password for role 'admin'; "),  # was: "KeyError"
    ('{"nats": {"admin": "pw"}, "redis": {"aios": "pw"}}', "auth/secrets.json has no Redis password for user 'admin'"),
])
def test_a_data_dirs_credentials_that_cannot_log_in_are_named_with_what_is_wrong(
        cli: CliRunner, tmp_path: Path, secrets: str | None, says: str) -> None:
    """A secrets file that is missing, no JSON, no object or without the role's passwords: one line
    naming the file and what is wrong, exit 2 (was the exception's kind alone, `FileNotFoundError`,
    `KeyError`, or a traceback), never a password."""
    data = tmp_path / "data"
    (data / "auth").mkdir(parents=True)
    (data / "endpoints.json").write_text(json.dumps({"nats": "nats://127.0.0.1:1", "redis": "redis://127.0.0.1:1/0",
                                                     "auth": True}))
    if secrets is not None:
        (data / "auth" / "secrets.json").write_text(secrets)
    for args in (["list"], ["submit", str(EXAMPLES / "block.yaml")]):
        r = cli.invoke(app, args)
        assert r.exit_code == 2 and (r.exception is None or isinstance(r.exception, SystemExit)), (args, r.output)
        text = _one_line(r.output)
        assert text.startswith(f"Cannot read the credentials of the servers in {data}: {data}/") and says in text, text
        assert "pw" not in text and "Traceback" not in r.output


def test_an_endpoints_file_without_addresses_says_each_missing_one(cli: CliRunner, tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "endpoints.json").write_text('{"auth": false}')
    r = cli.invoke(app, ["list"])
    assert r.exit_code == 2, r.output
    assert _one_line(r.output).endswith(f"{data}/endpoints.json has no 'nats' address; "
                                        f"{data}/endpoints.json has no 'redis' address"), r.output
    (data / "endpoints.json").write_text("garbage")
    r = cli.invoke(app, ["list"])
    assert r.exit_code == 2 and f"{data}/endpoints.json is not JSON (Expecting value at line 1 column 1)" in r.output
    for args in (["observer", "add", "zz"], ["tenant", "add", "tt"]):  # (were "error: Expecting value: ...", no file named)
        r = cli.invoke(app, args)
        assert r.exit_code == 2 and f"{data}/endpoints.json is not JSON (Expecting value at line 1 column 1)" in r.output, r.output


@pytest.mark.parametrize(("creds", "says"), [
    ("{}", "no 'url', no 'user', no 'password'"),  # was "url", exit 1 (a KeyError taken for an unknown tenant)
    ('{"url": "nats://127.0.0.1:1", "tenant": "t"}', "no 'user', no 'password'"),
    ("[1]", "not a JSON object"),
])
def test_a_tenant_credentials_file_without_its_fields_says_each_missing_one(
        cli: CliRunner, tmp_path: Path, creds: str, says: str) -> None:
    path = tmp_path / "creds.json"
    path.write_text(creds)
    import os
    import subprocess
    import sys

    for args in (["submit", str(EXAMPLES / "block.yaml"), "-c", str(path)], ["watch", "b1", "-c", str(path)],
                 ["explain", "b1", "-c", str(path)], ["tenant", "history", "b1", "-c", str(path)]):
        # as the installed command runs (its entry point turns an input error into one line, exit 2)
        r = subprocess.run([sys.executable, "-m", "aios_blocks.cli", *args], capture_output=True, text=True,
                           timeout=60, env={**os.environ, "COLUMNS": "400"})
        text = _one_line(r.stdout + r.stderr)
        assert r.returncode == 2 and "Traceback" not in text, (args, r.returncode, text)
        assert f"{path} is no tenant credentials file (`blocks tenant add T --json`): {says}" in text, (args, text)


def test_blocks_agent_names_every_bad_option_before_looking_for_servers(cli: CliRunner) -> None:
    """--sim-gpus -1 offered no GPU, --gpu-topology and --metrics-port failed after connecting
    ('agent failed', exit 1), and a bad node id hid them all."""
    r = cli.invoke(app, ["agent", "--node-id", "bad id", "--cluster", "lab", "--runtime", "process", "--sim-gpus", "-1",
                         "--gpu-topology", "nope", "--metrics-port", "99999", "--cpu", "0", "--memory", "-5"])
    out = _one_line(r.output)
    assert r.exit_code == 2, r.output
    for part in ("invalid node: id:", "--sim-gpus must be >= 0, got -1", "unknown GPU topology profile 'nope'",
                 "--metrics-port must be a port 1-65535 (0: off), got 99999", "--cpu must be a number of CPUs > 0, got 0.0",
                 "--memory must be MiB > 0, got -5"):
        assert part in out, (part, out)
    assert "No NATS" not in out and "agent failed" not in out


@pytest.mark.parametrize("args", [["settings"], ["worker", "autoscaler"]])
def test_settings_that_do_not_fit_are_bad_input_exit_2(args: list[str], tmp_path: Path) -> None:
    """Each AIOS_* setting that does not fit is named (one line each) and the exit code is 2, bad
    input, as for every other command's; it was 1 ('refused')."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("AIOS_")}
    env.update(AIOS_AUTOSCALE_TICK_S="0", AIOS_HEALTH_INTERVAL_S="-1", AIOS_DATA_DIR=str(tmp_path / "data"),
               AIOS_NATS_URL="nats://127.0.0.1:1", AIOS_REDIS_URL="redis://127.0.0.1:1/0")
    r = subprocess.run([sys.executable, "-m", "aios_blocks.cli", *args], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "AIOS_AUTOSCALE_TICK_S" in r.stderr and "AIOS_HEALTH_INTERVAL_S" in r.stderr and "Traceback" not in r.stderr, r.stderr
