"""Triton's interpreter without its repeated patching of triton.language, for the tests
(tests/conftest.py installs it).

To run a kernel, the interpreter swaps the builtins of triton.language (tl.load, tl.dot, tensor
methods, ...) for versions that compute with numpy: `interpreter._patch_lang(fn)` walks the
language modules that `fn`'s module sees (triton.language, triton.language.core) with
inspect.getmembers and patches them; the launch restores what it patched when the grid is done.
It also calls `_patch_lang` at every call of a @triton.jit helper, in every program of the grid,
alike in Triton 3.6 and 3.9. Only a helper's first call from a module can patch anything new
(triton.language.standard's helpers see triton.language.core, which a kernel module may not);
every later call from that module walks the same modules again and sets the same patches, and
those walks took about 30% of the suite's interpreter time (cProfile).

`install()` makes `_patch_lang` walk once per module and launch: a helper's call from a module
whose functions have been patched for in this launch returns at once; every other call, and the
launch's restore, run as they ship. Nothing the kernels compute changes
(tests/test_interpreter_speed.py checks results bit for bit with and without it).
"""

import contextlib

from triton.runtime import interpreter

ORIGINAL = interpreter._patch_lang
_launches = []  # per launch in progress: the ids of the module globals patched for


class _AlreadyPatched:
    """What a repeated call gets: nothing to restore (a helper's call ignores it anyway)."""

    def restore(self):
        pass


def _patch_lang(fn):
    module = id(fn.__globals__)
    if _launches:  # a helper's call inside a launch
        if module in _launches[-1]:
            return _AlreadyPatched()
        _launches[-1].add(module)
        return ORIGINAL(fn)
    scope = ORIGINAL(fn)  # a launch's own call
    restore = scope.restore

    def restore_and_close():
        _launches.pop()
        restore()

    scope.restore = restore_and_close
    _launches.append({module})
    return scope


def install():
    interpreter._patch_lang = _patch_lang


def uninstall():
    interpreter._patch_lang = ORIGINAL


def installed():
    return interpreter._patch_lang is _patch_lang


@contextlib.contextmanager
def shipped():
    """Inside the block, the interpreter patches at every helper call, as it ships."""
    was = installed()
    uninstall()
    try:
        yield
    finally:
        if was:
            install()
