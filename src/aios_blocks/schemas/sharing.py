"""GPU sharing rules: when a resourceAllocator's ``settings.gpuSharing`` is allowed.

Sharing stacks instances on one GPU while their ``gpuMemory`` figures fit in the GPU's memory and
their ``gpuShare`` figures (fractions of its compute) sum to at most 1 (the reservation script
checks both atomically). They are the only bounds on how many instances share a GPU, so sharing
with neither (``gpuMemory: 0``, no ``gpuShare``) would let any number stack: such a component or
block is refused, with the reason, at ``component add`` and at parse.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

SHARING_KEY = "gpuSharing"
#: env var of an instance that shares its GPUs: the GPU memory (MiB, per GPU) it was reserved
GPU_MEMORY_LIMIT_ENV = "AIOS_GPU_MEMORY_LIMIT_MIB"
#: env var of an instance that shares its GPUs with a ``gpuShare``: that fraction of each GPU's compute
GPU_SHARE_ENV = "AIOS_GPU_SHARE"


def sharing_problems(rule: Mapping[str, Any] | None, resources: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(where, message) for each problem of a resourceAllocator ``rule`` with these ``resources``.

    ``where`` is ``"settings"`` or ``"resources"``: the caller turns it into a JSON path.
    """
    settings = (rule or {}).get("settings") or {}
    if SHARING_KEY not in settings:
        return []
    share = settings[SHARING_KEY]
    if not isinstance(share, bool):  # bool("false") is True: a string must not switch sharing on
        return [("settings", f"settings.{SHARING_KEY} must be true or false, got {share!r}")]
    gpus, gpu_memory = int(resources.get("gpus") or 0), int(resources.get("gpuMemory") or 0)
    if share and gpus > 0 and gpu_memory <= 0 and not resources.get("gpuShare"):
        return [(
            "resources",
            f"settings.{SHARING_KEY} is true but resources.gpuMemory is {gpu_memory}: a shared GPU is divided by "
            "gpuMemory (MiB each instance takes of it) and/or gpuShare (its fraction of the GPU's compute), so without "
            "either any number of instances would stack on one GPU; set gpuMemory > 0 or gpuShare > 0, or turn gpuSharing off",
        )]
    return []
