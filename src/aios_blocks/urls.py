"""Server URLs in messages: their passwords hidden."""

from __future__ import annotations

import re

_USERINFO = re.compile(r"(?P<scheme>[a-z][a-z0-9+.-]*://)(?P<user>[^:@/\s]*)(?::[^@/\s]*)?@", re.I)


def mask(text: str) -> str:
    """Hide the password of every URL in ``text`` (``nats://u:secret@h`` -> ``nats://u:***@h``)."""
    return _USERINFO.sub(lambda m: f"{m['scheme']}{m['user']}:***@", text)
