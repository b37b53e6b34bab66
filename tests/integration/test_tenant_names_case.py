"""Tenant and tenant-user names that differ only in case (``acme``, ``Acme``) are refused when new
(exit 2, naming the existing one): they were two accounts, credentials folders and quota tenants
that a reader takes for one (and one folder on a case-insensitive file system). Names stored so by
an older version stay readable."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from aios_blocks.runtime import auth

from .conftest import System

pytestmark = pytest.mark.integration


def _blocks(data_dir: Path, *args: str) -> tuple[int, str]:
    """The real entry point (its one-line refusals and exit codes)."""
    r = subprocess.run([sys.executable, "-m", "aios_blocks.cli", *args, "--data-dir", str(data_dir)],
                       capture_output=True, text=True, timeout=120)
    return r.returncode, r.stdout if "--json" in args else " ".join((r.stdout + r.stderr).split())


async def test_tenant_and_user_names_that_differ_only_in_case_are_refused(system: System) -> None:
    if system.servers is None:
        pytest.skip("your own servers: tenants are accounts of the embedded one")
    d = system.data_dir
    code, said = await asyncio.to_thread(_blocks, d, "tenant", "add", "acme")
    assert code == 0, said
    code, said = await asyncio.to_thread(_blocks, d, "tenant", "add", "Acme")
    assert code == 2 and "tenant 'Acme' differs from the existing 'acme' only in case" in said, said
    assert (await asyncio.to_thread(_blocks, d, "tenant", "add", "acme"))[0] == 0  # the same name again: fine
    code, said = await asyncio.to_thread(_blocks, d, "tenant", "user", "add", "acme", "Main")
    assert code == 2 and "user of tenant 'acme' 'Main' differs from the existing 'main' only in case" in said, said
    assert (await asyncio.to_thread(_blocks, d, "tenant", "user", "add", "acme", "dash"))[0] == 0
    code, said = await asyncio.to_thread(_blocks, d, "tenant", "user", "add", "acme", "DASH")
    assert code == 2 and "'dash' only in case" in said, said
    rows = auth.tenants(d)
    assert [r["tenant"] for r in rows] == ["acme"] and sorted(rows[0]["users"]) == ["acme.dash", "acme.main"], rows

    # two such names an older version stored: both still read (list, get), a third refused
    s = auth.Secrets.load(d.resolve(), create=False)
    s.tenants["Acme"] = s.tenants["acme"]
    s.save()
    code, out = await asyncio.to_thread(_blocks, d, "tenant", "list", "--json")
    assert code == 0, out
    assert sorted(r["tenant"] for r in json.loads(out)) == ["Acme", "acme"]
    code, said = await asyncio.to_thread(_blocks, d, "tenant", "add", "ACME")
    assert code == 2 and "only in case" in said, said
