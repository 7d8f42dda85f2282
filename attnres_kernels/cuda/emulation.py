"""The CUDA kernels run on CPU tensors by the SIMT harness (DESIGN.md §4).

With ``ATTNRES_CUDA_EMULATE=1``, ``backend="cuda"`` accepts CPU tensors: the op
family's ``attnres_emu::`` ops run the device code of ``csrc/cuda/`` compiled by
the host C++ compiler against ``csrc/simt/simt.h`` (CUDA threads as fibers,
barriers, warp shuffles through a per-warp exchange buffer), with the launch
configuration of the real build. The module is built with
``torch.utils.cpp_extension.load`` on first use (about a minute) into
``build/cuda_emu`` of the source checkout and reused while the sources are
unchanged. Each launch is logged with the global-memory bytes it read and
wrote per buffer (:func:`launch_log`).

Adding a kernel family: add its ``.cpp`` (if any) to :data:`SOURCES`, its op
names to :data:`OPS`, and register its fakes/autograd in :func:`_register`.
"""

from __future__ import annotations

import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

ENV = "ATTNRES_CUDA_EMULATE"
ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "csrc"
SOURCES = [CSRC / "simt" / "simt.cpp", CSRC / "simt" / "warp_matrix.cpp", CSRC / "simt" / "emulated_ops.cpp"]
OPS = frozenset({"depth_attn_fwd", "depth_attn_bwd", "attn_fwd", "attn_bwd", "block_step_fwd", "block_step_bwd"})

_lock = threading.Lock()
_state: dict = {"loaded": False, "error": None}


def requested() -> bool:
    """Whether ``ATTNRES_CUDA_EMULATE=1`` asks for the emulated CUDA backend."""
    return os.environ.get(ENV, "0") == "1"


def _register() -> None:
    from ..ops._registration import register_attention_ops, register_block_step_ops, register_depth_attn_ops

    register_depth_attn_ops(
        "attnres_emu::depth_attn_fwd", "attnres_emu::depth_attn_bwd", torch.ops.attnres_emu.depth_attn_bwd.default
    )
    register_attention_ops("attnres_emu::attn_fwd", "attnres_emu::attn_bwd", torch.ops.attnres_emu.attn_bwd.default)
    register_block_step_ops(
        "attnres_emu::block_step_fwd", "attnres_emu::block_step_bwd", torch.ops.attnres_emu.block_step_bwd.default
    )


def load() -> str | None:
    """Builds (first use) and loads the emulated ops; returns why they are unavailable, or None."""
    if not requested():
        return f"set {ENV}=1 to run the CUDA kernels on CPU tensors under the SIMT harness"
    if _state["loaded"]:
        return None
    with _lock:
        if _state["loaded"] or _state["error"] is not None:
            return _state["error"]
        if not all(s.exists() for s in SOURCES):
            _state["error"] = f"the CUDA kernel sources are not in {CSRC} (the emulation needs a source checkout)"
            return _state["error"]
        try:
            from torch.utils.cpp_extension import load as load_extension

            build = ROOT / "build" / "cuda_emu"
            build.mkdir(parents=True, exist_ok=True)
            if not (build / "attnres_cuda_emu.so").exists():
                print(
                    f"attnres_kernels: building the emulated CUDA kernels in {build} (about a minute)", file=sys.stderr
                )
            load_extension(
                name="attnres_cuda_emu",
                sources=[str(s) for s in SOURCES],
                extra_cflags=["-O2", "-std=c++20"],
                build_directory=str(build),
                is_python_module=False,
                verbose=False,
            )
            _register()
            _state["loaded"] = True
        except Exception as exc:  # a failed build is reported as the backend's reason
            _state["error"] = f"building the emulated CUDA kernels failed: {exc}"
        return _state["error"]


def unavailable_reason(op: str) -> str | None:
    """Why ``backend="cuda"`` cannot run op ``op`` on CPU tensors, or None if it can."""
    if op not in OPS:
        return f"the CUDA emulation has no kernel of {op}"
    return load()


@dataclass(frozen=True)
class Launch:
    """One kernel launch of the harness: configuration and global-memory traffic
    per buffer group (``{group: (bytes read, bytes written)}``, ``"untracked"``
    for addresses outside every named buffer)."""

    kernel: str
    grid: tuple
    block: tuple
    shared_bytes: int
    traffic: dict

    def read(self, group: str) -> int:
        return self.traffic.get(group, (0, 0))[0]

    def written(self, group: str) -> int:
        return self.traffic.get(group, (0, 0))[1]


def launch_log() -> list:
    """The :class:`Launch` records of every emulated launch since the last call (then cleared)."""
    if load() is not None:
        return []
    launches = []
    for line in torch.ops.attnres_emu.launch_log().splitlines():
        kernel, grid, block, shared, traffic = line.split("\t")
        groups = {}
        for item in traffic.split():
            name, read, written = item.rsplit(":", 2)
            groups[name] = (int(read), int(written))
        launches.append(
            Launch(
                kernel,
                tuple(int(x) for x in grid.split(",")),
                tuple(int(x) for x in block.split(",")),
                int(shared),
                groups,
            )
        )
    return launches
