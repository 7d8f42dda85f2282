"""The fused backends, as each registers itself (docs/design.md §3).

The op layer (:mod:`attnres_kernels.ops`) picks a backend by name and calls its
``torch.library`` ops, but imports none: each backend's package registers a
:class:`Backend` here when it is imported (``"cpu"``: :mod:`attnres_kernels._native`,
``"cuda"``: :mod:`attnres_kernels.cuda`, ``"triton"``: :mod:`attnres_kernels.triton.backend`).
The package root names where each lives (:func:`locate`); it is imported on first use,
so that a backend that cannot run here costs nothing (importing Triton takes about a second).

A backend that defines ops in a namespace of its own (Triton's on first use, the emulated
CUDA kernels when built) says so with :func:`ops_defined`; the op layer, which owns their
fake kernels and autograd, registers them then (:func:`when_ops_defined`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import NamedTuple


class Backend(NamedTuple):
    """What a fused backend tells the op layer about itself."""

    title: str  # how messages name its kernels: "the {title} kernels"
    # Why it cannot run the op ``op`` (e.g. "depth_attn_fwd") on tensors of ``device``, or None if it can.
    unavailable_reason: Callable  # (device, op) -> str | None
    ops: Callable  # (device) -> the torch.ops namespace of its ops on tensors of ``device``
    # The widest row its depth-read and Block-step kernels take for a dtype; None: any width.
    max_dim: Callable | None  # (dtype) -> int


_registered: dict = {}  # name -> Backend
_modules: dict = {}  # name -> the module that registers it on import (not imported yet)
_namespaces: list = []  # namespaces whose ops a backend defined, in order
_listeners: list = []  # callbacks of when_ops_defined


def register(name: str, backend: Backend) -> None:
    """Registers the fused backend ``name`` (its package calls this when it is imported)."""
    _registered[name] = backend


def locate(name: str, module: str) -> None:
    """Says that importing ``module`` registers the backend ``name``: :func:`get` imports it on first use."""
    _modules[name] = module


def get(name: str) -> Backend:
    """The fused backend ``name``, its package imported if this is the first use."""
    backend = _registered.get(name)
    if backend is None:
        importlib.import_module(_modules.pop(name))
        backend = _registered[name]
    return backend


def ops_defined(namespace: str) -> None:
    """Says that a backend defined its ``torch.library`` ops in ``namespace``."""
    _namespaces.append(namespace)
    for callback in _listeners:
        callback(namespace)


def when_ops_defined(callback: Callable) -> None:
    """Calls ``callback(namespace)`` for every namespace of :func:`ops_defined`, past and future."""
    _listeners.append(callback)
    for namespace in _namespaces:
        callback(namespace)
