"""What runs on each rank: communicators per mesh axis, the collectives, the vocab-parallel losses,
binding a compiled program to process groups, and the user-facing ``ParallelModule``.

Imports only ``autoshard.ir``, never the compiler (``autoshard.passes``).
"""
from autoshard.runtime.comm import AxisComm, Tracer
from autoshard.runtime.module import ParallelModule

__all__ = ["AxisComm", "Tracer", "ParallelModule"]
