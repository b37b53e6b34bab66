"""Block services that serve tasks: the routing and admission engine (``engine``), the ingress of
tasks from NATS and HTTP (``ingress``) and their dispatch to instances (``dispatch``), passive
health (``outlier``), outputs (``outputs``); the worker that runs them on the bus is
``workers/executor.py``, the instance maps they route by are the mapper's (``workers/mapper.py``)."""
