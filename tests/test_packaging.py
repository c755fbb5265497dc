"""The bundled configs are found however the project is used: from a source checkout on
PYTHONPATH (the GPU test machine), an editable install (CI), or a wheel (``pip install .``),
from any working directory."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.child_env import child_pythonpath

ROOT = Path(__file__).resolve().parents[1]

#: Loads a bundled config by name and prints where the package and the config came from.
PROBE = (
    "import kvcache, sys\n"
    "from kvcache.config.loading import bundled_config_dir, load_config\n"
    "config = load_config('tiny-cpu')\n"
    "assert config.cache.num_blocks == 24, config\n"
    "assert 'torch' not in sys.modules\n"
    "print(kvcache.__file__)\n"
    "print(bundled_config_dir())\n"
)


def _run(args: list[str], cwd: Path, pythonpath: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath is not None:
        env["PYTHONPATH"] = child_pythonpath(pythonpath)
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_packages_listed_in_pyproject_are_the_tree() -> None:
    """pyproject lists its packages (to map configs/ onto kvcache.configs); a new subpackage
    must be listed too, or wheels would lack it."""
    tomllib = pytest.importorskip("tomllib", reason="tomllib needs Python 3.11")
    from setuptools import find_packages

    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = find_packages(where=str(ROOT), include=["kvcache*", "attention*"])
    examples = find_packages(where=str(ROOT), include=["examples*"])
    shipped_examples = {name.replace("examples", "kvcache_examples", 1): name.replace(".", "/") for name in examples}
    assert sorted(setuptools["packages"]) == sorted([*found, "kvcache.configs", *shipped_examples])
    assert setuptools["package-dir"] == {"kvcache.configs": "configs", **shipped_examples}
    assert setuptools["package-data"]["kvcache.configs"] == ["*.yaml"]


def test_source_checkout_on_pythonpath(tmp_path: Path) -> None:
    result = _run([sys.executable, "-c", PROBE], tmp_path, str(ROOT))
    assert result.returncode == 0, result.stderr
    package, configs = result.stdout.split()
    assert Path(package).is_relative_to(ROOT) and Path(configs) == ROOT / "configs"
    result = _run([sys.executable, "-m", "kvcache.cli", "validate", "tiny-cpu"], tmp_path, str(ROOT))
    assert result.returncode == 0 and result.stdout.startswith("tiny-cpu: ok"), result.stderr


def test_editable_install(tmp_path: Path) -> None:
    """CI installs the project with ``pip install -e``: then no PYTHONPATH is needed."""
    result = _run([sys.executable, "-c", PROBE], tmp_path, None)
    if result.returncode != 0 and "No module named 'kvcache'" in result.stderr:
        pytest.skip("the project is not installed in this interpreter")
    installed = result.stdout.split()[0] if result.returncode == 0 else ""
    if result.returncode != 0 or not Path(installed).is_relative_to(ROOT):
        pytest.skip(f"the installed kvcache is another checkout's ({installed or result.stderr[-200:]})")
    assert Path(result.stdout.split()[1]) == ROOT / "configs"


@pytest.mark.slow
def test_wheel_install_carries_the_configs(tmp_path: Path) -> None:
    """Build and install the project as pip does (``--target``, no network: the build uses this
    interpreter's setuptools), then load a bundled config from elsewhere."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        major = int(version("setuptools").split(".")[0])
    except (PackageNotFoundError, ValueError):
        major = 0
    if major < 77:  # pyproject's `license = "Apache-2.0"` (PEP 639) needs setuptools 77
        pytest.skip("building this pyproject without network needs setuptools >= 77 in this interpreter")
    source = tmp_path / "src"  # a copy: pip builds in place, leaving build/ behind
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for name in ("kvcache", "attention", "configs", "examples"):
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    target = tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(target),
           str(source)]
    built = _run(pip, tmp_path, None)
    assert built.returncode == 0, built.stderr[-2000:]
    assert sorted(p.name for p in (target / "kvcache" / "configs").glob("*.yaml")) == sorted(
        p.name for p in (ROOT / "configs").glob("*.yaml"))
    assert not (target / "configs").exists()  # no top-level "configs" package in site-packages
    assert not (target / "examples").exists()  # nor "examples": it ships as kvcache_examples
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    result = _run([sys.executable, "-c", PROBE], elsewhere, str(target))
    assert result.returncode == 0, result.stderr
    package, configs = result.stdout.split()
    assert Path(package).is_relative_to(target) and Path(configs) == target / "kvcache" / "configs"
    # The example program runs from there too, under its installed name and as the script.
    example = [sys.executable, "-m", "kvcache_examples.decode_loop", "--requests", "3", "--quiet"]
    ran = _run(example, elsewhere, str(target))
    assert ran.returncode == 0 and "requests: 3 (3 finished" in ran.stdout, ran.stderr[-2000:]
    script = target / "bin" / "kvcache-example"
    assert script.is_file()
    ran = _run([sys.executable, str(script), "--requests", "2", "--quiet"], elsewhere, str(target))
    assert ran.returncode == 0 and "requests: 2 (2 finished" in ran.stdout, ran.stderr[-2000:]
