"""A head's directory on disk: `config.json` beside `model.safetensors`, the layout every head kind and
every export writes. Each file is written under a temporary name and renamed, so a reader (or a training
run stopped mid-write) never sees half a file. Knows nothing about what the tensors mean."""

from __future__ import annotations

import json
from pathlib import Path

import torch

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


def write_head(directory: str | Path, tensors: dict[str, torch.Tensor], config: dict) -> Path:
    """Write `tensors` (made contiguous, on the CPU) and `config` into `directory`; returns it."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    partial = directory / (WEIGHTS_FILE + ".partial")
    save_file({name: t.detach().contiguous().cpu() for name, t in tensors.items()}, str(partial), metadata={"format": "pt"})
    partial.replace(directory / WEIGHTS_FILE)
    partial = directory / (CONFIG_FILE + ".partial")
    partial.write_text(json.dumps(config, indent=2) + "\n")
    partial.replace(directory / CONFIG_FILE)
    return directory
