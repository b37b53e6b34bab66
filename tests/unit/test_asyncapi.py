"""The AsyncAPI 3.0 document (``blocks asyncapi``) covers the whole catalog, and the reference
parser (npm's ``@asyncapi/parser``) accepts it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from aios_blocks.bus import asyncapi, catalog

ROOT = Path(__file__).resolve().parents[2]
VALIDATE = Path(__file__).with_name("asyncapi") / "validate.mjs"
PARSER_VERSION = "3.6.6"


def test_every_event_has_a_channel_message_and_its_publishers_operations() -> None:
    doc = asyncapi.document()
    assert doc["asyncapi"] == "3.0.0"
    assert len(doc["channels"]) == len(catalog.EVENTS) + len(asyncapi.TASKS)  # (and a task's answer, on the inbox)
    for e in catalog.EVENTS:
        ch = doc["channels"][asyncapi.channel_id(e)]
        assert ch["address"] == e.pattern
        assert sorted(ch.get("parameters", {})) == sorted(e.tokens)
        msg = doc["components"]["messages"][asyncapi.channel_id(e)]
        if e.body is catalog.Body.CLOUDEVENT and e.payload is not None:  # (a create: a CloudEvent or a bare spec)
            assert msg["payload"]["properties"]["type"]["const"] == e.type
            assert msg["payload"]["properties"]["data"]["$ref"].endswith("/" + e.payload.__name__)  # type: ignore[union-attr]
        for role in e.publishers:
            op = doc["operations"][f"{role.value}_sends_{asyncapi.channel_id(e)}"]
            assert op["action"] == "send" and op["channel"]["$ref"] == f"#/channels/{asyncapi.channel_id(e)}"
    # every $ref resolves inside the document
    def refs(node: Any) -> list[str]:
        if isinstance(node, dict):
            return ([node["$ref"]] if "$ref" in node else []) + [r for v in node.values() for r in refs(v)]
        if isinstance(node, list):
            return [r for v in node for r in refs(v)]
        return []

    for ref in refs(doc):
        target: Any = doc
        for part in ref.removeprefix("#/").split("/"):
            target = target[part]
        assert target, ref


def test_consumers_receive_exactly_their_events() -> None:
    doc = asyncapi.document()
    received = {k for k, v in doc["operations"].items() if v["action"] == "receive"}
    expected = {f"{c.durable.replace('-', '_')}_receives_{asyncapi.channel_id(e)}" for c in asyncapi.CONSUMERS for e in c.events}
    assert received == expected and "lifecycle_receives_block_instance_added" in received


def _parser_dir() -> Path:
    """``@asyncapi/parser`` installed once under the venv (npm reaches the registry on CI)."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        if os.environ.get("CI"):
            pytest.fail("node and npm are needed to validate the AsyncAPI document (apt-get install nodejs npm)")
        pytest.skip("node/npm not installed")
    where = ROOT / ".venv" / "asyncapi-parser"
    if not (where / "node_modules" / "@asyncapi" / "parser" / "package.json").exists():
        where.mkdir(parents=True, exist_ok=True)
        r = subprocess.run(
            ["npm", "install", "--prefix", str(where), "--no-audit", "--no-fund", "--silent", f"@asyncapi/parser@{PARSER_VERSION}"],
            capture_output=True, text=True, timeout=600,
        )
        assert r.returncode == 0, r.stderr[-2000:]
    shutil.copy(VALIDATE, where / "validate.mjs")
    return where


def _validate(where: Path, doc: dict[str, Any], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "doc.json"
    path.write_text(json.dumps(doc))
    return subprocess.run(["node", str(where / "validate.mjs"), str(path)], capture_output=True, text=True, timeout=120)


def test_the_reference_parser_accepts_the_document_and_rejects_a_broken_one(tmp_path: Path) -> None:
    where = _parser_dir()
    r = _validate(where, asyncapi.document(), tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"VALID: {len(catalog.EVENTS) + len(asyncapi.TASKS)} channels" in r.stdout
    broken = asyncapi.document()
    first = next(iter(broken["channels"].values()))
    first["messages"] = {"x": {"$ref": "#/components/messages/no_such_message"}}
    r = _validate(where, broken, tmp_path)
    assert r.returncode != 0 and "INVALID" in r.stderr, r.stdout + r.stderr


def test_blocks_asyncapi_writes_the_document(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from aios_blocks.cli.main import app

    out = tmp_path / "aios.asyncapi.json"
    r = CliRunner().invoke(app, ["asyncapi", "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert json.loads(out.read_text()) == json.loads(json.dumps(asyncapi.document()))
