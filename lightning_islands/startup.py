"""A process's start: its imports with the cyclic garbage collector paused.

Importing torch, Lightning and Hydra makes about a million objects that live as long as the
process, and almost no garbage. The collector still runs every few hundred new objects and walks
the older ones again and again, then walks all of them again at its first collections after the
imports: a fifth of the CPU an island's process spends before its first step (0.8 s of 4 s on a
loaded 2-core machine), paid by every process of every launch.

:func:`startup_imports` pauses the collector while its body imports and resumes it after. In the
module a process starts with (``main``: ``__name__ == "__main__"``), it first moves everything
alive to the permanent generation (:func:`gc.freeze`), which no later collection walks; garbage
made later is collected as before. Imported by another program (a test), the module freezes
nothing of that program's::

    with startup_imports(main=__name__ == "__main__"):
        import lightning.pytorch as pl
        import torch
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def startup_imports(main: bool) -> Iterator[None]:
    """Run the body (imports) without garbage collection, then, if ``main`` (the body runs in the
    module the process started with, before anything else), freeze what is alive
    (:func:`gc.freeze`); then resume collecting, unless the collector was off already."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if main:
            gc.freeze()
        if enabled:
            gc.enable()
