"""Exercises of the notebooks: stubs to complete, checks with specific feedback, hints.

    from moelora_lab.exercises import check
    check("02.expand_once", expand_kernel)        # prints what is right or wrong

``python -m moelora_lab.exercises list | check | check --stubs`` (see ``__main__``). Each notebook's
exercises live in ``nb<NN>.py``; the framework in ``core``; the load/store counter in ``memory``.
"""
from . import nb01, nb02, nb03, nb04, nb05, nb06, nb07, nb08, nb09, nb10  # noqa: F401  (each registers its exercises)
from .core import EXERCISES, KINDS, Exercise, Result, check, get, hint, load_solution, load_source
from .memory import MemoryCount, count_memory

__all__ = ["EXERCISES", "KINDS", "Exercise", "MemoryCount", "Result", "check", "count_memory", "get", "hint",
           "load_solution", "load_source"]
