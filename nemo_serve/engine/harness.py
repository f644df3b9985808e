"""Moved: the in-process engine is core/inproc.py (the engine core class driven in this process).

Kept as a name so code written against the old place goes on working while branches merge; new
code imports nemo_serve.core.inproc."""

from ..core.inproc import LocalEngine, LocalStream

__all__ = ["LocalEngine", "LocalStream"]
