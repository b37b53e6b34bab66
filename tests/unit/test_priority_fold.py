"""The fold rebuilds priority classes and quotas from their events (issue 36): what
``state.priority.PriorityStore`` writes, one default class, removals."""

from __future__ import annotations

import msgspec

from aios_blocks.recovery.fold import Fold
from aios_blocks.state import keys

from .test_recovery_fold import run


def test_classes_and_quotas_fold_into_their_hashes() -> None:
    f = Fold()
    run(f, [
        ("aios.priorityclass.normal.registered", {"name": "normal", "record": {"name": "normal", "value": 100, "default": True}}),
        ("aios.priorityclass.batch.registered", {"name": "batch", "record": {"name": "batch", "value": 0, "default": True}}),
        ("aios.priorityclass.tmp.registered", {"name": "tmp", "record": {"name": "tmp", "value": 5, "default": False}}),
        ("aios.priorityclass.tmp.removed", {"name": "tmp"}),
        ("aios.quota.team-a.set", {"name": "team-a", "record": {"tenant": "team-a", "cohort": "lab", "nominal": {"*": {"gpus": 2.0}}}}),
        ("aios.quota.gone.set", {"name": "gone", "record": {"tenant": "gone", "nominal": {}}}),
        ("aios.quota.gone.set", {"name": "gone", "record": None}),
    ])
    img = f.image()
    classes = {k: msgspec.json.decode(v) for k, v in img[keys.PRIORITY_CLASSES].items()}
    assert classes == {"normal": {"name": "normal", "value": 100, "default": False},
                       "batch": {"name": "batch", "value": 0, "default": True}}
    assert set(img[keys.QUOTAS]) == {"team-a"}
