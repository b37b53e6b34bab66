"""``blocks submit SPEC --tenant T`` / ``-c CREDS`` (docs/security.md "Tenants"): the CLI logs in as
the tenant's user (its credentials file, as ``blocks tenant add`` writes it), publishes the tenant's
create, and with ``--wait`` follows the tenant's own events to the answer of this create: ready
(the block is the tenant's), a rejected spec with its every problem, an unknown tenant, a password
the server refuses; each with its exit code and words."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest

from aios_blocks.runtime import auth

from .conftest import System

pytestmark = pytest.mark.integration
#: the system fixture waits for the gateway's tenant desk (a tenant's create goes through it)
NEEDS_DESK = True


async def blocks(*args: str) -> tuple[int, str, str]:
    """The ``blocks`` command as run next to ``blocks up`` (no server URL in its environment)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIOS_")}
    proc = await asyncio.create_subprocess_exec(str(Path(sys.executable).with_name("blocks")), *args, env=env,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 150)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_a_tenant_submits_its_block_from_the_cli(system: System, tmp_path: Path) -> None:
    if system.servers is None:
        pytest.skip("your own servers: tenants are accounts of the embedded one")
    c, data = system.client, str(system.data_dir)
    await c.add_sim_cluster("ts", nodes=1, gpus=2)
    auth.add_tenant(system.data_dir, "sa")
    spec = tmp_path / "block.json"
    spec.write_text(json.dumps({"blockId": "sa-b1", "blockComponentURI": "aios://test/model", "minInstances": 1,
                                "maxInstances": 1}))

    rc, out, err = await blocks("submit", str(spec), "--tenant", "sa", "--wait", "--timeout", "90", "--data-dir", data)
    assert rc == 0, (out, err)
    assert "submitted sa-b1 as tenant sa (gen " in out and "ready" in out, out
    block = await c.store.get_block("sa-b1")
    assert block is not None and block["status"] == "ready" and block["ir"]["labels"]["tenant"] == "sa"

    # a spec with problems: each one listed, exit 4 (the tenant's own rejected, relayed to it)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"blockId": "sa-b2", "blockComponentURI": "aios://test/model", "minInstances": 3,
                               "maxInstances": 1, "colour": "red"}))
    creds = auth.credentials_path(system.data_dir, "sa", "main")
    rc, out, err = await blocks("submit", str(bad), "-c", str(creds), "--wait", "--timeout", "60")
    assert rc == 4, (out, err)
    assert "rejected $.minInstances" in err and "rejected $.colour: unknown field" in err, err

    # an unknown tenant: exit 1, saying how to make one
    rc, out, err = await blocks("submit", str(spec), "--tenant", "nobody", "--data-dir", data)
    assert rc == 1 and "no tenant 'nobody'" in err and "blocks tenant add nobody" in err, (out, err)
    # a file of another tenant than the one named: a usage mistake
    rc, out, err = await blocks("submit", str(spec), "--tenant", "other", "-c", str(creds), "--data-dir", data)
    assert rc == 2 and "tenant 'sa'" in err, (out, err)
    # a password the server refuses: exit 2, said as such (not "cannot reach the servers")
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({**json.loads(creds.read_text()), "password": "not-it"}))
    rc, out, err = await blocks("submit", str(spec), "-c", str(wrong))
    assert rc == 2 and "refused the credentials" in err and "Cannot reach" not in err, (out, err)
    # the admin's own options that read the system's state are not a tenant's
    rc, out, err = await blocks("submit", str(spec), "--tenant", "sa", "--dry-run", "--data-dir", data)
    assert rc == 2 and "no --dry-run" in err, (out, err)
