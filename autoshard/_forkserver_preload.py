"""What ``autoshard.launcher``'s forkserver imports once, before it forks any rank; imported in that server only.

torch, torch.distributed and autoshard first, then each module named in ``AUTOSHARD_PRELOAD`` (comma-separated),
resolved on the server's path (the installed packages and the directory the first launch ran in). A name
that fails to import warns and is left to the ranks that need it: multiprocessing's own preload lets any
error but ImportError end the server, and with it every later launch of the process.

CUDA must stay uninitialised here, since a forked rank cannot use a context its parent made: torch's
availability checks go through NVML, and a module that initialises CUDA anyway is reported.
"""
import importlib
import os
import warnings

os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

import torch  # noqa: E402

for _name in ("torch.distributed", "autoshard.launcher"):
    importlib.import_module(_name)


def _preload(names: str):
    for name in filter(None, (m.strip() for m in names.split(","))):
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - any failure leaves the import to the ranks
            warnings.warn(f"AUTOSHARD_PRELOAD: {name} did not import in the launcher's forkserver "
                          f"({type(e).__name__}: {e}); each rank imports it when it needs it", stacklevel=1)
    if torch.cuda.is_initialized():
        warnings.warn(f"AUTOSHARD_PRELOAD ({names}) initialised CUDA in the launcher's forkserver: ranks forked "
                      "from it cannot use the GPU; preload fewer modules or set AUTOSHARD_START_METHOD=spawn",
                      stacklevel=1)


_preload(os.environ.get("AUTOSHARD_PRELOAD", ""))
