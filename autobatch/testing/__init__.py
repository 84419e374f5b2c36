"""Tools for testing training code against out-of-memory errors on any machine.

:class:`SimulatedGPU` gives the CPU a GPU's memory limit and CUDA's out-of-memory error;
:func:`inject_oom` raises a chosen backend's out-of-memory error at a chosen point.
"""

from __future__ import annotations

from autobatch.testing._inject import OOM_KINDS, inject_oom
from autobatch.testing._simulator import SimulatedGPU, SimulatedMemory, current_simulator

__all__ = ["OOM_KINDS", "SimulatedGPU", "SimulatedMemory", "current_simulator", "inject_oom"]
