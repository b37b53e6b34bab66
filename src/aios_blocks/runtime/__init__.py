"""The processes around the workers: the worker entry (``main``), the supervisor, the embedded
servers and their credentials (``embedded``, ``auth``, ``locate``, ``lifetime``), the one periodic
loop (``ticker``) and the subject -> handler table (``routes``). It may import every layer; no
pure layer (``handlers``, ``policies``, ``schemas``) nor ``state``/``bus`` imports it."""
