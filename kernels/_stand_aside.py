"""The top-level name `kernels`, where this folder is found under it, handed to whom it belongs.

From a checkout's root the folder `kernels/` is importable as `kernels`, a name that belongs to
another project on PyPI (the Hugging Face hub's kernels), which libraries probe for: transformers
imports `kernels` to read its version whenever it finds a module of that name. Under that name this
folder must not load fastformer's ops (a second copy would register the torch.library ops twice);
it gives the name to the other project when that is installed, else stays an empty package that
tells a user who imports from it where fastformer's ops are.
"""

import importlib.machinery
import importlib.util
import sys
from pathlib import Path

WRONG_IMPORT = "fastformer's ops are the package fastformer.kernels, not {name!r}: use `from fastformer import kernels`"


def stand_aside(name, folder):
    """Called by kernels/__init__.py when it is imported as `name` rather than as fastformer.kernels,
    with its own folder. Puts the other project's module in sys.modules[name] when one is found on
    the path outside the folder's parent (the import statement returns it); else makes the module
    being imported an empty package whose attributes raise ImportError naming the right import."""
    module = sys.modules[name]
    if "." not in name:
        others = [entry for entry in sys.path if _resolved(entry) != folder.parent]
        spec = importlib.machinery.PathFinder.find_spec(name, others)
        if spec is not None and spec.loader is not None:
            other = importlib.util.module_from_spec(spec)
            sys.modules[name] = other
            try:
                spec.loader.exec_module(other)
            except BaseException:
                sys.modules[name] = module
                raise
            return
    module.__path__ = []  # no submodule of this folder loads under this name either

    def __getattr__(attribute):
        if attribute.startswith("__"):  # what import machinery and version probes ask: absent
            raise AttributeError(attribute)
        raise ImportError(WRONG_IMPORT.format(name=name))

    module.__getattr__ = __getattr__


def _resolved(entry):
    """A sys.path entry as a resolved folder ("" is the working directory)."""
    try:
        return Path(entry or ".").resolve()
    except OSError:
        return None
