"""The CLI as a new user meets it: every mistake is one clear line and an exit code (2: bad input,
1: refused, e.g. unknown), never a traceback; list commands; the system is found from anywhere."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from .conftest import System
from .test_cli import BLOCKS, ROOT, blocks

BAD_YAML = "a: [\n"


def _bad_invocations(tmp: Path) -> list[tuple[tuple[str, ...], int, str]]:
    (tmp / "bad.yaml").write_text(BAD_YAML)
    (tmp / "list.yaml").write_text("- 1\n")
    (tmp / "p.py").write_text("class X: pass\n")
    bad, lst, pol = str(tmp / "bad.yaml"), str(tmp / "list.yaml"), str(tmp / "p.py")
    inp = str(ROOT / "examples" / "allocation_input.json")
    return [
        # (arguments, exit code, what the one line must say)
        (("cluster", "add", "bad.id"), 2, "cluster id 'bad.id' is not a valid id"),
        (("cluster", "add", "c9", "-l", "key"), 2, "expected key=value, got 'key'"),
        (("cluster", "add", "c9", "--gpus", "-3"), 2, "'--gpus'"),
        (("cluster", "add", "c9", "--nodes", "0"), 2, "'--nodes'"),
        (("cluster", "add", "c9", "--gpu-memory", "0"), 2, "'--gpu-memory'"),
        (("cluster", "list", "--bogus"), 2, "No such option: --bogus"),
        (("node", "add", "n9", "--cluster", "c1", "-l", "k"), 2, "expected key=value, got 'k'"),
        (("node", "add", "bad.node", "--cluster", "c1"), 2, "node id 'bad.node' is not a valid id"),
        (("node", "add", "n9", "--cluster", "c1", "--gpus", "-1"), 2, "'--gpus'"),
        (("node", "list", "--cluster", "nope"), 1, "no cluster 'nope'"),
        (("component", "add", "/nonexistent.yaml"), 2, "cannot read /nonexistent.yaml"),
        (("component", "add", bad), 2, "is not valid YAML: line 2, column 1"),
        (("component", "add", lst), 2, "must hold an object"),
        (("submit", bad), 2, "is not valid YAML"),
        (("submit",), 2, "Missing argument"),
        (("submit", str(ROOT / "examples" / "block.yaml"), "--timeout", "x"), 2, "'--timeout'"),
        # refused before anything is published (they were: "timed out after -1.0s", exit 5)
        (("submit", str(ROOT / "examples" / "block.yaml"), "--wait", "--timeout", "-1"), 2, "'--timeout': expected seconds > 0"),
        (("submit", str(ROOT / "examples" / "block.yaml"), "--timeout", "nan"), 2, "'--timeout': expected seconds > 0"),
        (("scale", "nosuch", "--timeout", "inf"), 2, "'--timeout': expected seconds > 0"),
        (("task", "a.b"), 2, "block id 'a.b' is not a valid id"),  # was: 503 "no executor is running"
        (("task", "nosuch", "--timeout", "0"), 2, "'--timeout': expected seconds > 0"),
        (("top", "a.b", "--json"), 2, "block id 'a.b' is not a valid id"),
        (("top", "--interval", "nan"), 2, "'--interval': expected seconds >= 0.1"),
        (("node", "drain", "n1", "--wait", "-1"), 2, "'--wait': expected seconds >= 0"),
        (("check", "--stuck-after", "nan"), 2, "expected seconds >= 1"),
        (("get", "a.b"), 2, "block id 'a.b' is not a valid id"),
        (("get", "nosuch"), 1, "no block nosuch"),
        (("scale", "a.b"), 2, "is not a valid id"),
        (("scale", "nosuch"), 1, "no block 'nosuch'"),
        (("reassign", "nosuch", "x>"), 2, "is not a valid id"),
        (("delete", "a.b"), 2, "is not a valid id"),
        (("watch", "a.b"), 2, "is not a valid id"),
        (("replay", "a b"), 2, "is not a valid id"),
        (("explain", "a.b"), 2, "is not a valid id"),
        (("policy", "test", "x", pol, "--since", "yesterday"), 2, "--since: expected seconds or a duration"),
        (("policy", "test", "x", pol, "--since", "nan"), 2, "--since: expected seconds or a duration"),
        (("policy", "run", pol, "--input", "/nope.json"), 2, "cannot read /nope.json"),
        (("policy", "run", pol, "--input", inp, "--parameters", "{bad"), 2, "--parameters: not JSON"),
        (("policy", "run", pol, "--input", inp, "--settings", "[1]"), 2, "--settings: expected a JSON object"),
        (("policy", "run", str(tmp / "nope.py"), "--input", inp), 2, f"no policy file {tmp / 'nope.py'}"),  # was: exit 1, "no policy registry available"
        (("policy", "run", pol, "--input", inp, "--kind", "bogus"), 2, "--kind 'bogus': expected one of"),  # was: run as "bogus"
        (("policy", "show", "nosuch"), 1, "no policy nosuch"),
        (("policy", "input", "a.b"), 2, "is not a valid id"),
        (("policy", "input", "x", "--index", "x"), 2, "'--index'"),
        (("check", "--stuck-after", "0"), 2, "'--stuck-after'"),
        (("up", "--controllers", "-1"), 2, "'--controllers'"),
        (("worker", "nope"), 2, "unknown worker kind 'nope'"),
        (("agent", "--node-id", "a.b", "--cluster", "c1", "--runtime", "sim"), 2, "invalid node"),
        (("state", "digest", "--bogus"), 2, "No such option: --bogus"),
        (("frobnicate",), 2, "No such command 'frobnicate'"),
    ]


def test_every_mistake_is_one_line_and_an_exit_code(system: System, tmp_path: Path) -> None:
    assert blocks(system, "cluster", "add", "c1", "--nodes", "1", "--gpus", "1").returncode == 0
    failures = []
    for args, code, says in _bad_invocations(tmp_path):
        r = blocks(system, *args, timeout=60)
        lines = [line for line in r.stderr.splitlines() if line.strip()]
        if r.returncode != code or "Traceback" in r.stderr + r.stdout or len(lines) != 1 or says not in lines[0]:
            failures.append(f"{' '.join(args)}: exit {r.returncode} (want {code}), stderr {r.stderr!r}")
    assert not failures, "\n".join(failures)


async def test_list_commands_show_components_clusters_and_nodes(system: System) -> None:
    assert blocks(system, "cluster", "add", "c1", "-l", "region=eu", "--nodes", "2", "--gpus", "2").returncode == 0
    assert blocks(system, "cluster", "add", "c2", "--nodes", "1", "--gpus", "1").returncode == 0
    _, kind, _ = await system.submit_and_wait({"blockComponentURI": "aios://test/model", "blockId": "l-1",
                                               "minInstances": 1, "maxInstances": 1})
    assert kind == "ready"
    comps = json.loads(blocks(system, "component", "list", "--json").stdout)
    assert list(comps) == ["aios://test/model"] and comps["aios://test/model"]["image"] == "aios/test:1"
    clusters = {c["id"]: c for c in json.loads(blocks(system, "cluster", "list", "--json").stdout)}
    assert clusters["c1"]["labels"] == {"region": "eu"} and clusters["c1"]["nodes"] == 2 and clusters["c2"]["gpus"] == 1
    assert sum(c["gpus_free"] for c in clusters.values()) == 4  # 5 GPUs, 1 holds l-1's instance
    nodes = json.loads(blocks(system, "node", "list", "--cluster", "c1", "--json").stdout)
    assert sorted(n["node_id"] for n in nodes) == ["c1-n0", "c1-n1"]
    assert len(json.loads(blocks(system, "node", "list", "--json").stdout)) == 3
    r = blocks(system, "node", "list")  # a table, piped: every id whole (folded, never cut with "…")
    assert r.returncode == 0 and all(n in r.stdout for n in ("c1-n0", "c1-n1", "c2-n0")) and "…" not in r.stdout


def test_subjects_piped_at_80_columns_keeps_every_subject() -> None:
    from aios_blocks.bus import subjects

    env = {**os.environ, "COLUMNS": "80"}
    r = subprocess.run([*BLOCKS, "subjects"], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0 and "…" not in r.stdout
    flat = "".join(line.split("│")[1].strip() if "│" in line else "" for line in r.stdout.splitlines())
    missing = [p for p, _, _ in subjects.catalog() if p not in flat]
    assert not missing, missing


def _running_data_dir(system: System) -> Path:
    assert system.servers is not None
    return system.servers.data_dir


async def test_the_cli_finds_a_running_system_from_anywhere(system: System, tmp_path: Path) -> None:
    if system.servers is None:
        pytest.skip("needs the embedded servers (a data dir)")
    data = _running_data_dir(system)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIOS_")}

    def run(*args: str, cwd: Path, **extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*BLOCKS, *args], capture_output=True, text=True, timeout=60, cwd=cwd, env={**env, **extra})

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    assert run("list", "--data-dir", str(data), cwd=elsewhere).returncode == 0  # 1. --data-dir
    assert run("list", cwd=elsewhere, AIOS_DATA_DIR=str(data)).returncode == 0  # 2. AIOS_DATA_DIR
    r = run("list", "--data-dir", str(tmp_path / "nope"), cwd=elsewhere, AIOS_DATA_DIR=str(data))
    assert r.returncode == 2 and f"{tmp_path / 'nope'} (--data-dir)" in r.stderr  # the flag wins
    # 3. ./.aios-data, here or in a parent directory (as git finds .git)
    project = tmp_path / "project"
    (project / "src" / "deep").mkdir(parents=True)
    (project / ".aios-data").symlink_to(data)
    assert run("list", cwd=project).returncode == 0
    assert run("list", cwd=project / "src" / "deep").returncode == 0
    r = run("list", cwd=elsewhere)  # nothing anywhere: says where it looked
    assert r.returncode == 2 and "No servers" in r.stderr
    assert f"./.aios-data and every parent directory of {elsewhere}" in r.stderr
    r = run("list", cwd=elsewhere, AIOS_DATA_DIR=str(tmp_path / "nope"))
    assert r.returncode == 2 and f"{tmp_path / 'nope'} (AIOS_DATA_DIR)" in r.stderr


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_server_that_cannot_be_reached_is_one_line_and_exit_2_not_a_hang(system: System) -> None:
    # NATS away: nats-py's default retries the first connection for ever (the CLI hung, printing
    # a warning twice a second); Redis away: a redis-py traceback
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIOS_")}
    nats_away = {"AIOS_NATS_URL": f"nats://u:secret@127.0.0.1:{_closed_port()}", "AIOS_REDIS_URL": system.supervisor.redis_url}
    redis_away = {"AIOS_NATS_URL": system.supervisor.nats_url, "AIOS_REDIS_URL": f"redis://127.0.0.1:{_closed_port()}"}
    # (`blocks list` reads Redis only: NATS away, it still lists; `replay` reads the stream)
    for cmd, extra, says in ((["replay"], nats_away, "cannot connect to NATS at nats://u:***@127.0.0.1:"),
                             (["list"], redis_away, "cannot connect to Redis"), (["get", "b1"], redis_away, "cannot connect to Redis")):
        r = subprocess.run([*BLOCKS, *cmd], capture_output=True, text=True, timeout=60, cwd=ROOT, env={**env, **extra})
        lines = [line for line in r.stderr.splitlines() if line.strip()]
        assert r.returncode == 2, r.stderr
        assert len(lines) == 1 and "Cannot reach the servers" in lines[0] and says in lines[0], r.stderr
        assert "secret" not in r.stderr + r.stdout and "Traceback" not in r.stderr


def test_a_reader_that_closes_the_pipe_is_not_a_server_that_cannot_be_reached(system: System, tmp_path: Path) -> None:
    # `blocks replay --json | head -1`: the BrokenPipeError of stdout (a ConnectionError) was said
    # as "Cannot reach the servers" with exit 2; now the command stops quietly (exit 0)
    spec = tmp_path / "b.yaml"
    spec.write_text("blockComponentURI: aios://test/model\nblockId: pipe-1\nminInstances: 1\nmaxInstances: 1\n")
    assert blocks(system, "cluster", "add", "c1", "--nodes", "1", "--gpus", "1").returncode == 0
    assert blocks(system, "submit", str(spec), "--wait").returncode == 0
    env = {**os.environ, "AIOS_NATS_URL": system.supervisor.nats_url, "AIOS_REDIS_URL": system.supervisor.redis_url}
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first line: every write to stdout fails
    try:
        r = subprocess.run([*BLOCKS, "replay", "pipe-1", "--json"], stdout=write_end, stderr=subprocess.PIPE, text=True,
                           timeout=90, cwd=ROOT, env=env)
    finally:
        os.close(write_end)
    assert r.returncode == 0, r.stderr
    assert "Cannot reach the servers" not in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_blocks_up_that_cannot_start_its_servers_says_why_in_one_line_and_exits_2(tmp_path: Path) -> None:
    # were a RuntimeError's traceback and exit 1 (no such Redis binary, one that exits at once), and
    # "[Errno 17] File exists" for a --data-dir that is a file
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIOS_")}
    (tmp_path / "a-file").write_text("")
    for extra, data, says in (({"AIOS_REDIS_SERVER": "/nonexistent/redis-server"}, tmp_path / "d1", "AIOS_REDIS_SERVER=/nonexistent/redis-server: no such executable"),
                              ({"AIOS_REDIS_SERVER": "/bin/false"}, tmp_path / "d2", "redis-server exited with 1"),
                              ({}, tmp_path / "a-file", f"--data-dir {tmp_path / 'a-file'} is not a directory")):
        r = subprocess.run([*BLOCKS, "up", "--data-dir", str(data)], capture_output=True, text=True, timeout=60, cwd=tmp_path,
                           env={**env, **extra})
        lines = [line for line in r.stderr.splitlines() if line.strip()]
        assert r.returncode == 2 and "Traceback" not in r.stderr + r.stdout, (extra, r.stderr)
        assert len(lines) == 1 and says in lines[0], (extra, r.stderr)
        assert not (data / "endpoints.json").exists()


def test_blocks_console_finds_no_system_as_every_command_does(tmp_path: Path) -> None:
    # it said "no running `blocks up` in .aios-data" (not where it looked), and with an endpoints.json
    # left by a `blocks up` that died it tried to connect for 10 s before "cannot connect to NATS"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIOS_")}
    stale = tmp_path / "stale"
    stale.mkdir()
    (stale / "endpoints.json").write_text(json.dumps({"nats": f"nats://127.0.0.1:{_closed_port()}",
                                                      "redis": f"redis://127.0.0.1:{_closed_port()}/0", "auth": False}))
    for args, says in ((["--data-dir", str(tmp_path / "none")], f"No running `blocks up` found in {tmp_path / 'none'} (--data-dir)"),
                       ([], f"every parent directory of {tmp_path}"),
                       (["--data-dir", str(stale)], "is left from a `blocks up` that is no longer running")):
        r = subprocess.run([*BLOCKS, "console", *args], capture_output=True, text=True, timeout=30, cwd=tmp_path, env=env)
        lines = [line for line in r.stderr.splitlines() if line.strip()]
        assert r.returncode == 2 and "Traceback" not in r.stderr, (args, r.stderr)
        assert len(lines) == 1 and "No servers" in lines[0] and says in lines[0], (args, r.stderr)


def test_blocks_up_on_servers_that_do_not_answer_says_so(tmp_path: Path) -> None:
    # with AIOS_NATS_URL / AIOS_REDIS_URL to nothing it printed "up: ..." and the workers retried in
    # their logs only, so nothing said why no command worked
    import signal
    import time

    env = {k: v for k, v in os.environ.items() if not k.startswith("AIOS_")}
    env.update(AIOS_NATS_URL=f"nats://u:secret@127.0.0.1:{_closed_port()}", AIOS_REDIS_URL=f"redis://127.0.0.1:{_closed_port()}/0")
    err = tmp_path / "err"
    with err.open("w") as f:
        proc = subprocess.Popen([*BLOCKS, "up", "--no-console", "--data-dir", str(tmp_path / "d")], cwd=tmp_path, env=env,
                                stdout=subprocess.DEVNULL, stderr=f, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while err.read_text().count("warning: nothing answers at") < 2:
            assert proc.poll() is None and time.monotonic() < deadline, err.read_text()
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
    text = err.read_text()
    assert "nats://u:***@127.0.0.1:" in text and "(NATS): the workers keep trying" in text and "(Redis)" in text, text
    assert "secret" not in text and "Traceback" not in text


async def test_list_shows_a_rejected_blocks_problems_as_words_not_json(system: System,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """`blocks list` printed a rejected block's reason as the JSON list it is stored as
    (`[{"path":"$.colour","message":"unknown field"},...]`); it now says each problem as `blocks get`
    does, `$.path: message`, while `--json` keeps the stored reason."""
    _, kind, _ = await system.submit_and_wait({"blockComponentURI": "aios://test/model", "blockId": "l-bad",
                                               "minInstances": 2, "maxInstances": 1, "colour": "red"})
    assert kind == "rejected"
    monkeypatch.setenv("COLUMNS", "400")  # one line a block
    r = blocks(system, "list")
    line = next(line for line in r.stdout.splitlines() if "l-bad" in line)
    assert "$.colour: unknown field" in line and "$.minInstances: minInstances (2) is greater" in line, line
    assert '"path"' not in r.stdout and '"message"' not in r.stdout, r.stdout
    [row] = [b for b in json.loads(blocks(system, "list", "--json").stdout) if b["id"] == "l-bad"]
    assert [e["path"] for e in json.loads(row["reason"])] == ["$.colour", "$.minInstances"]
