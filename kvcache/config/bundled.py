"""The configs shipped with the package, loadable by name: ``load_config("tiny-cpu")``.

They live in the repository's ``configs/`` folder (the README and users refer to
``configs/llama3-8b.yaml``). A wheel carries them as ``kvcache/configs/`` (pyproject maps
``configs/`` onto the package ``kvcache.configs``); a source checkout on PYTHONPATH and an
editable install read ``configs/`` itself. Imports neither pydantic nor YAML.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["bundled_config_dir", "bundled_configs", "is_bare_name"]


def bundled_config_dir() -> Path | None:
    """The folder of the configs shipped with the package, or None when there is none."""
    package = Path(__file__).resolve().parents[1]  # kvcache/
    installed = package / "configs"  # a wheel
    if installed.is_dir():
        return installed
    checkout = package.parent / "configs"  # a checkout or an editable install: next to pyproject.toml
    if checkout.is_dir() and (package.parent / "pyproject.toml").is_file():
        return checkout
    return None


def bundled_configs() -> dict[str, Path]:
    """Name -> file of each config shipped with the package (``tiny-cpu``, ``llama3-8b``, ...),
    sorted by name."""
    folder = bundled_config_dir()
    if folder is None:
        return {}
    return {path.stem: path for path in sorted(folder.glob("*.yaml"), key=lambda p: p.stem)}


def is_bare_name(path: object) -> bool:
    """Whether ``path`` is a str with no path separator and no ``.yaml``/``.yml`` suffix: the
    form that names a bundled config. (A ``Path`` is always a path.)"""
    if not isinstance(path, str) or path in ("", ".", ".."):
        return False
    separators = {"/", os.sep, os.altsep or "/"}
    return not any(sep in path for sep in separators) and not path.lower().endswith((".yaml", ".yml"))
