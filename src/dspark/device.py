"""Where the training-side commands run their tensors: ``--device auto|cpu|cuda``.

``train-draft``, ``prepare-features`` and ``draft-data --source sharegpt`` take the same option. "auto" is CUDA when
torch sees a GPU, else the CPU. On CUDA the PyTorch reference path runs (the native kernels are CPU-only: the process
turns them off once, and ``dspark.native.status()`` says so) and the reduced-precision regions autocast to bf16 on that
device. The serving engine (generate, serve, bench, verify-lossless) stays on the CPU.
"""

from __future__ import annotations

import torch

import dspark.native as native

DEVICES = ("auto", "cpu", "cuda")


def resolve_device(name: str | torch.device | None = "auto") -> torch.device:
    """ "auto" | "cpu" | "cuda" | "cuda:N" → a torch.device this process can use; a CUDA device also turns the native
    CPU kernels off for the process. Raises ValueError naming the value and the fix."""
    if isinstance(name, torch.device):
        name = str(name)
    name = (name or "auto").strip().lower()
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    kind = name.split(":", 1)[0]
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"--device {name!r}: use one of {', '.join(DEVICES)} (or cuda:N)")
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"--device {name}: torch {torch.__version__} sees no CUDA device here; use --device cpu (or auto)"
            )
        device = torch.device(name)
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) are visible")
        native.disable(f"models on {name}")
        return device
    return torch.device("cpu")


def autocast(device: torch.device | str, enabled: bool) -> torch.autocast:
    """The bf16 autocast region of training forwards on ``device`` (a no-op when not ``enabled``)."""
    kind = torch.device(device).type
    return torch.autocast(kind, dtype=torch.bfloat16, enabled=enabled)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA timings); nothing on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
