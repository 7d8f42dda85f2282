"""Callbacks run when a module is first imported, by whichever code imports it.

The package registers things with two heavy optional parts of PyTorch: DTensor rules
of its ops (``torch.distributed.tensor``) and a constant-result mark for
``torch.compile`` (``torch._dynamo``). Importing either only to register with it cost
about a second each, half of ``import attnres_kernels``; nothing can need the
registrations before that module is imported (no DTensor exists, nothing is being
compiled), so they wait for it: :func:`when_imported`.
"""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Callable

_pending: dict = {}  # module name -> callbacks waiting for its first import


class _CallbacksAfterExec(importlib.abc.Loader):
    """The module's own loader, then the callbacks waiting for the module (taken when it
    executes, not when its spec is found: ``importlib.util.find_spec`` finds a spec without
    importing); every other loader attribute (resource readers, ``get_data``, ...) is the
    wrapped loader's."""

    def __init__(self, loader, name: str):
        self._loader = loader
        self._name = name

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        for callback in _pending.pop(self._name, ()):
            callback(module)

    def __getattr__(self, name: str):
        return getattr(self._loader, name)


class _WaitingFinder(importlib.abc.MetaPathFinder):
    """First on ``sys.meta_path``: for a module with callbacks, the spec that the
    finders after it give, its loader wrapped; for any other module, nothing."""

    def find_spec(self, fullname: str, path, target=None):
        if fullname not in _pending:
            return None
        for finder in sys.meta_path:
            find_spec = getattr(finder, "find_spec", None)
            if finder is self or find_spec is None:
                continue
            spec = find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _CallbacksAfterExec(spec.loader, fullname)
                return spec
        return None


_FINDER = _WaitingFinder()


def when_imported(name: str, callback: Callable) -> None:
    """Calls ``callback(module)`` once the module ``name`` is imported: now if it has been,
    else right after its first import executes it."""
    module = sys.modules.get(name)
    if module is not None:
        callback(module)
        return
    _pending.setdefault(name, []).append(callback)
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
