"""Simulated node agent: serves every simulated node's ``instance.create`` / ``instance.remove``.

No process is started; after a configurable delay the instance is reported ``added`` (or, with a
configured failure rate, ``removed`` with reason ``start failed``). Real runtimes are the node
agent's job (Docker / process); this one is for the demo and scale tests.
"""

from __future__ import annotations

import asyncio
import os
import random
from typing import Any

from ..bus import subjects
from ..bus.runner import Delivery
from ..schemas.events import InstanceCommand, InstanceEvent, data_as, decode_envelope
from .base import Worker

START_DELAY_S = float(os.environ.get("AIOS_SIM_START_DELAY_S", 0.05))
FAIL_RATE = float(os.environ.get("AIOS_SIM_FAIL_RATE", 0.0))


def bindings(w: Worker) -> list[tuple[subjects.ConsumerSpec, Any]]:
    async def on_command(d: Delivery) -> None:
        cmd = data_as(decode_envelope(d.data), InstanceCommand)
        if d.subject.endswith(".instance.create"):
            await asyncio.sleep(START_DELAY_S)
            failed = FAIL_RATE > 0 and random.random() < FAIL_RATE
            event, reason = ("removed", "start failed (simulated)") if failed else ("added", "")
        else:
            event, reason = "removed", cmd.reason or "removed"
        ev = InstanceEvent(cmd.block_id, cmd.gen, cmd.instance_id, cmd.node_id, cmd.gpus, reason)
        await w.bus.publish(
            subjects.instance_event(cmd.block_id, cmd.instance_id, event),
            f"block.instance.{event}",
            ev,
            f"{cmd.block_id}:{cmd.gen}:{event}:{cmd.instance_id}",
        )

    return [(subjects.agent(), on_command)]
