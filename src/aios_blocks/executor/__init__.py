"""Block services that serve tasks: the routing and admission engine (``engine``), the instance
map's decisions (``mapper``); the worker that runs them on the bus is ``workers/executor.py``."""
