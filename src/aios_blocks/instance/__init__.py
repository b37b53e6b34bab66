"""The instance SDK: write a task handler, ``serve`` it (docs/instance-sdk.md).

* :func:`serve` — the HTTP server of an instance: the block's task path, ``/health``, ``/metrics``;
* :class:`InstanceApp` — the same without a server (unit tests call ``await app.call(task)``);
* :class:`Metrics` — system metrics (in-flight, queue, latency, errors) and the handler's own.
"""

from .app import Context, InstanceApp, Reply, Task, TaskError
from .metrics import Metrics, SystemMetrics
from .server import run, serve, web_app

__all__ = ["Context", "InstanceApp", "Metrics", "Reply", "SystemMetrics", "Task", "TaskError", "run", "serve", "web_app"]
