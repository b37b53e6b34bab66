"""A tiny local Docker image for tests, benchmarks and trying the Docker runtime offline: a static
busybox plus a one-file HTTP server answering ``/health`` on ``$AIOS_PORT``. Built with
``docker import`` from a tarball (nothing is pulled). Needs a static busybox on the host
(Debian: ``busybox-static``)."""

from __future__ import annotations

import io
import shutil
import tarfile
from pathlib import Path
from typing import Any

TAG = "aios-test/busybox:1"

SERVE = """#!/bin/sh
# /health answers 200 while the file exists; the instance's init data is served at /init.json
mkdir -p /tmp/www
echo ok > /tmp/www/health
printf '%s' "$blockInitData" > /tmp/www/init.json
exec /bin/busybox httpd -f -p "127.0.0.1:${AIOS_PORT:-8080}" -h /tmp/www
"""


def find_busybox() -> Path:
    for cand in ("/bin/busybox", "/usr/bin/busybox", shutil.which("busybox") or ""):
        if cand and Path(cand).exists():
            return Path(cand)
    raise FileNotFoundError("no busybox binary: apt-get install busybox-static")


def build_tar(busybox: Path) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for d in ("bin", "tmp", "aios"):
            info = tarfile.TarInfo(d)
            info.type, info.mode = tarfile.DIRTYPE, 0o1777 if d == "tmp" else 0o755
            tar.addfile(info)
        tar.add(str(busybox), arcname="bin/busybox")
        for name in ("sh", "httpd", "sleep", "cat", "mkdir", "printf", "echo", "rm", "ls"):
            link = tarfile.TarInfo(f"bin/{name}")
            link.type, link.linkname = tarfile.SYMTYPE, "busybox"
            tar.addfile(link)
        data = SERVE.encode()
        info = tarfile.TarInfo("serve.sh")
        info.size, info.mode = len(data), 0o755
        tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def ensure_image(client: Any, tag: str = TAG) -> str:
    """Build ``tag`` unless the engine already has it; returns the tag."""
    from docker.errors import ImageNotFound

    try:
        client.images.get(tag)
        return tag
    except ImageNotFound:
        pass
    repo, _, version = tag.partition(":")
    client.api.import_image_from_data(
        build_tar(find_busybox()), repository=repo, tag=version or "latest",
        changes=['CMD ["/serve.sh"]', "ENV PATH=/bin"],
    )
    client.images.get(tag)
    return tag
