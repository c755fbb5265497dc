"""Runnable examples: a Llama-style model decoding through the paged KV cache.

``decode_loop`` is the program (``python -m examples.decode_loop``); ``model`` holds the model
and its checkpoints, ``engine`` the serving loop's parts. Module paths from before those
packages (``examples.llama``, ``examples.scheduler``, ...) still import.

In a checkout this package is ``examples``. An installed project (``pip install paged-kvcache``)
ships the same files as ``kvcache_examples``, so the program runs from any directory as
``kvcache-example`` or ``python -m kvcache_examples.decode_loop``; the modules import each
other relatively, so both names work.
"""

from kvcache import moved

#: Old module name -> the module that now holds its names.
MOVED_MODULES = {
    f"{__name__}.{old}": f"{__name__}.{new}"
    for old, new in {
        "llama": "model",
        "checkpoints": "model",
        "scheduler": "engine.scheduler",
        "runner": "engine.runner",
        "distributed": "engine.distributed",
    }.items()
}

moved.install(MOVED_MODULES)
