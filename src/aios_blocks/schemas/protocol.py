"""How a block's services talk to an instance over HTTP (seed 000 ``componentInputProtocol``).

An instance is any HTTP server at its ``endpoint`` (``InstanceEvent.endpoint``, also the
``endpoint`` field of its record in the state: ``http://host:port``) that answers:

* ``{method} {endpoint}{path}`` — a task, where ``path`` and ``method`` come from the block's
  ``inputProtocol`` (inherited from the component's ``componentInputProtocol``:
  ``{type: http, path: /v1/completions, method: POST}``); defaults ``/infer`` and ``POST``;
* ``GET {endpoint}/health`` — 200 once the instance is ready to take tasks, 503 before;
* ``GET {endpoint}/metrics`` — Prometheus text (``aios_instance_*`` from the instance SDK, or an
  engine's own names such as vLLM's ``vllm:num_requests_running``).

Every task the executor sends carries ``Aios-Instance: <instance id>``, the instance it means
(its map's entry for that endpoint). An instance that knows its own id and is another answers
``421 Misdirected Request`` without running the task (the instance SDK and the simulated fleet
do): an endpoint whose port now serves another instance, while an executor's map is behind, never
runs a task meant for the one that left. The executor takes 421 as "never reached".

An instance started with ``AIOS_INSTANCE_TOKEN`` in its environment (by an agent given its node's
instance key, ``runtime.instance_key``) takes tasks only with ``Aios-Instance-Token: <that
token>``, which the executors add on each try; anything else but ``GET /health`` and ``GET
/metrics`` is answered ``401`` unrun (the instance SDK and the simulated fleet do; a request meant
for another instance is 421 first). Without the variable it takes any caller's task.

The node agent picks the endpoint's port from the component's ``launch.ports``: the one named
``http`` if there is one, else the first; a simulated instance gets its own port.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping

DEFAULT_TASK_PATH = "/infer"
DEFAULT_TASK_METHOD = "POST"
HEALTH_PATH = "/health"
METRICS_PATH = "/metrics"
#: request header: the instance a task is meant for (answer header: the instance that answered)
INSTANCE_HEADER = "Aios-Instance"
#: an instance's answer to a task meant for another instance id: nothing was run
MISDIRECTED = 421
#: request header: the instance's own token (``runtime.instance_key``), set by the executors
INSTANCE_TOKEN_HEADER = "Aios-Instance-Token"
#: the variable an instance finds its token in (none: it asks callers for none)
INSTANCE_TOKEN_ENV = "AIOS_INSTANCE_TOKEN"
#: an instance's answer to a request without its token (or with a wrong one): nothing was run
UNAUTHORIZED = 401
#: the launch port the endpoint prefers
HTTP_PORT_NAME = "http"


def task_path(input_protocol: Mapping[str, object] | None) -> str:
    """The path tasks are sent to: ``inputProtocol.path`` (made absolute), else ``/infer``."""
    path = (input_protocol or {}).get("path")
    if not isinstance(path, str) or not path.strip():
        return DEFAULT_TASK_PATH
    path = path.strip()
    return path if path.startswith("/") else "/" + path


def task_method(input_protocol: Mapping[str, object] | None) -> str:
    method = (input_protocol or {}).get("method")
    return method.upper() if isinstance(method, str) and method.strip() else DEFAULT_TASK_METHOD


def misdirected(own_id: str, meant: str | None, what: str = "task") -> str:
    """Why a ``what`` (task, request) meant (``Aios-Instance``) for another instance than
    ``own_id`` is refused unrun (421), "" when it is not. No header (a direct caller) or no own id
    (run by hand): never misdirected."""
    if not meant or not own_id or meant == own_id:
        return ""
    return f"misdirected: this is instance {own_id}, not {meant} (the {what} was not run)"


def unauthorized(own_token: str, got: str | None, what: str = "task") -> str:
    """Why a ``what`` is refused unrun (401) for lacking the instance's token (``got``, its
    ``Aios-Instance-Token``), "" when it is not: no own token (an instance started without one)
    takes any caller's. Compared in constant time; the reason never holds either value."""
    if not own_token:
        return ""
    if got is None:
        return f"unauthorized: the {what} has no Aios-Instance-Token (only the executors may send this instance tasks)"
    if not hmac.compare_digest(own_token.encode(), got.encode("utf-8", "replace")):
        return f"unauthorized: the {what}'s Aios-Instance-Token is not this instance's"
    return ""


def endpoint_port(ports: dict[str, int]) -> int | None:
    """The port an instance serves HTTP on: the one named ``http``, else the first, else None."""
    if HTTP_PORT_NAME in ports:
        return int(ports[HTTP_PORT_NAME])
    for port in ports.values():
        return int(port)
    return None


def endpoint_url(host: str, port: int | None) -> str:
    """``http://host:port`` ("" without a port); IPv6 literals are bracketed."""
    if not port:
        return ""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{int(port)}"
