"""The metrics system (docs/metrics.md): reading Prometheus pages (``scrape``), the collector's
windows (``window``) and the Prometheus scrape config (``promconfig``). The collector worker is
``workers/collector.py``; the store is ``state/metrics.py``."""
