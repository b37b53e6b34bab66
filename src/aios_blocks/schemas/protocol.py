"""How a block's services talk to an instance over HTTP (seed 000 ``componentInputProtocol``).

An instance is any HTTP server at its ``endpoint`` (``InstanceEvent.endpoint``, also the
``endpoint`` field of its record in the state: ``http://host:port``) that answers:

* ``{method} {endpoint}{path}`` — a task, where ``path`` and ``method`` come from the block's
  ``inputProtocol`` (inherited from the component's ``componentInputProtocol``:
  ``{type: http, path: /v1/completions, method: POST}``); defaults ``/infer`` and ``POST``;
* ``GET {endpoint}/health`` — 200 once the instance is ready to take tasks, 503 before;
* ``GET {endpoint}/metrics`` — Prometheus text (``aios_instance_*`` from the instance SDK, or an
  engine's own names such as vLLM's ``vllm:num_requests_running``).

The node agent picks the endpoint's port from the component's ``launch.ports``: the one named
``http`` if there is one, else the first; a simulated instance gets its own port.
"""

from __future__ import annotations

from collections.abc import Mapping

DEFAULT_TASK_PATH = "/infer"
DEFAULT_TASK_METHOD = "POST"
HEALTH_PATH = "/health"
METRICS_PATH = "/metrics"
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
