"""The web console (issue 37, docs/console.md): one more projection of the stream.

``projection`` turns a ``recovery.fold.Fold`` (the same fold ``blocks recover`` writes Redis from)
into the views' JSON; ``feed`` keeps a live fold from NATS (observer rights) and folds the stream
up to a past sequence; ``server`` serves the views, server-sent events and the admin actions;
``token`` is the admin token's file (stdlib only: `blocks up` writes it)."""
