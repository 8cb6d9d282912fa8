"""The runtime inside a user's training script: reads a ``netweave launch`` bundle's job plan and carries it out.

It imports the plan format (:mod:`netweave.runtime.plan`) and torch only: no planners, no emulator.
torch is imported on first use of :func:`init` (or the other names below), so that reading a plan
(the CLI does) costs nothing but the standard library.

A few lines to adopt (the whole script: ``examples/train_transformer.py``)::

    import netweave.runtime as nw
    job = nw.init()                         # $NETWEAVE_JOB_PLAN, torchrun's RANK/WORLD_SIZE, the process group, t0
    model = job.data_parallel(model)        # DDP with the plan's communication hook
    for step in job.iterations(100):        # the start offset once, then the plan's period
        ...

Names: :func:`init`, :class:`Job`, :class:`ModelMismatchError`, :class:`PlanFormatError`,
:func:`trainable_parameters`, :data:`PLAN_ENV`.
"""

from __future__ import annotations

from typing import Any

from .plan import PlanFormatError

_LAZY = {"init": "job", "Job": "job", "PLAN_ENV": "job", "ModelMismatchError": "ddp", "trainable_parameters": "ddp",
         "PipelineRun": "pipeline"}

__all__ = ["PlanFormatError", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
