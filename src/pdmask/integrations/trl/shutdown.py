"""A deterministic end for multi-process runs (``accelerate launch`` / ``torchrun``).

Why: with the gloo backend (CPU), a process that has trained with DDP can deadlock in its
last moments. DDP's reducer holds the gloo process group, so ``destroy_process_group()``
does not destroy it; its C++ destructor runs later, when the trainer is garbage-collected,
on a thread that holds the GIL, and joins gloo's worker threads. A worker thread may still
be finishing its last work item: a barrier keeps (weak) references to the collectives
before it, and freeing the tensors of an all-gather whose Python objects were already
dropped needs the GIL. The main thread waits for the worker, the worker for the GIL.
Seen as 3 hangs in 40 two-process runs of ``examples/trl/train_grpo.py`` (ending with
``barrier(); destroy_process_group()``) on a loaded 2-core machine (stacks from ``py-spy dump``: ``~ProcessGroupGloo`` -> ``std::thread::join``
in the main thread, ``~AsyncBarrierWork`` -> ``~AsyncAllgatherWork`` ->
``gil_scoped_acquire`` in a gloo worker); see docs/trl.md. Gloo has no ``shutdown()`` that
would join its threads earlier (PyTorch issue 130345), so the only deterministic exit is
not to run that destructor at all.

:func:`finish_and_exit` therefore waits for every rank, finishes the trackers and destroys
the process group through ``accelerator.end_training()``, flushes logging and stdio, and
leaves with ``os._exit``. In a single process (no process group) it returns instead.
"""

from __future__ import annotations

import logging
import os
import sys


def finish_and_exit(trainer, code: int = 0) -> None:
    """End a multi-process run deterministically (see the module docstring); returns only
    when no process group is initialised (a single process, e.g. inside pytest).

    ``atexit`` handlers other than logging's do not run: anything that must reach the
    disk (checkpoints, trackers) has to be finished before -- ``trainer.train()`` and
    ``accelerator.end_training()`` (called here) take care of TRL's own.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    acc = trainer.accelerator
    acc.wait_for_everyone()  # every rank is past its last collective
    acc.end_training()       # trackers finished; destroy_process_group (the reducer keeps the group alive)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


__all__ = ["finish_and_exit"]
