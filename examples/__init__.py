"""Runnable examples: a Llama-style model decoding through the paged KV cache.

``decode_loop`` is the program (``python -m examples.decode_loop``); ``model`` holds the model
and its checkpoints, ``engine`` the serving loop's parts. Module paths from before those
packages (``examples.llama``, ``examples.scheduler``, ...) still import.
"""

from kvcache import moved

#: Old module name -> the module that now holds its names.
MOVED_MODULES = {
    "examples.llama": "examples.model",
    "examples.checkpoints": "examples.model",
    "examples.scheduler": "examples.engine.scheduler",
    "examples.runner": "examples.engine.runner",
    "examples.distributed": "examples.engine.distributed",
}

moved.install(MOVED_MODULES)
