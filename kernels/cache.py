"""Generated kernels live as ``.py`` files in a cache folder, named by a hash of their plan, and are
imported like any module: no ``exec``, a readable file per kernel for a person (and for Triton, whose
``@jit`` reads the function's source from its file).

The folder is ``$AUTOSHARD_KERNEL_CACHE``, else ``~/.cache/autoshard/kernels``. A file is written to a
temporary name and renamed, so a concurrent compile on another rank never imports half a file.
"""
from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
import threading
from pathlib import Path


def cache_dir() -> Path:
    root = os.environ.get("AUTOSHARD_KERNEL_CACHE") or os.path.join(Path.home(), ".cache", "autoshard", "kernels")
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


_LOCK = threading.Lock()   # two threads (the simulator's ranks) importing one module: one executes it


def load_source(module_name: str, source: str):
    """Write ``source`` as ``<cache>/<module_name>.py`` (unless that file holds it already) and import it."""
    with _LOCK:
        return _load(module_name, source)


def _load(module_name: str, source: str):
    path = cache_dir() / f"{module_name}.py"
    if not path.exists() or path.read_text() != source:
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(source)
        os.replace(tmp, path)
    if module_name in sys.modules:     # the name is a hash of the source: the loaded module is this one
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module
