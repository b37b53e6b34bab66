"""Example side-cars (docs/sidecars.md), written with :mod:`aios_blocks.sidecar`:

* ``python -m aios_blocks.examples.sidecars.sqlite_store``: every output of the block into a
  SQLite file (a real database; ``parameters.path``, default ``outputs.db`` in its working
  directory), one row per task id (``INSERT OR IGNORE``: a redelivered output is stored once);
* ``python -m aios_blocks.examples.sidecars.alert``: an alert (published on
  ``aios.block.{bid}.sidecar.{name}.alert``, logged, and appended to ``parameters.file`` if given)
  for every output whose text matches ``parameters.pattern`` (a regex).

``sidecar_block.yaml`` next to this package is a block spec that runs both with the echo instance.
"""
