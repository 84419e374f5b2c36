"""Tools for testing training code against out-of-memory errors on any machine.

:class:`SimulatedGPU` gives the CPU a GPU's memory limit and CUDA's out-of-memory error;
:func:`inject_oom` raises a chosen backend's out-of-memory error at a chosen point;
:func:`check_split` tells whether a training step is exact when autobatch splits its batch.
"""

from __future__ import annotations

from autobatch._recovery._check import SplitReport, check_split
from autobatch.testing._inject import OOM_KINDS, inject_oom
from autobatch.testing._simulator import SimulatedGPU, SimulatedMemory, current_simulator

__all__ = [
    "OOM_KINDS",
    "SimulatedGPU",
    "SimulatedMemory",
    "SplitReport",
    "check_split",
    "current_simulator",
    "inject_oom",
]
