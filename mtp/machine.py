"""The machine mtp runs on: its name, and the folder of what is measured or converted once on it."""

import json
import os
import platform
from collections.abc import Callable
from pathlib import Path

import torch


def cache_dir() -> Path:
    """Folder for converted GGUF models and measurements of this machine: `$MTP_CACHE`, else `~/.cache/mtp`."""
    return Path(os.environ.get("MTP_CACHE", Path.home() / ".cache" / "mtp"))


def device_name(device: str | torch.device) -> str:
    """The accelerator's name, or the CPU's model and the threads torch uses on it."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpuinfo = Path("/proc/cpuinfo")
    names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
             if line.startswith("model name")] if cpuinfo.is_file() else []  # fmt: skip
    return f"{names[0] if names else platform.processor() or platform.machine()} x{torch.get_num_threads()} threads"


def measured(file: str, key: str, measure: Callable[[], list], again: bool = False) -> list:
    """`measure()` as cached under `key` in `cache_dir() / file` (a JSON object), measured and stored first if it
    is not there yet, or if `again`."""
    store = cache_dir() / file
    cached = json.loads(store.read_text()) if store.is_file() else {}
    if again or key not in cached:
        cached[key] = measure()
        store.parent.mkdir(parents=True, exist_ok=True)
        store.with_suffix(".tmp").write_text(json.dumps(cached, indent=1))
        os.replace(store.with_suffix(".tmp"), store)  # written aside, then renamed: never half a file
    return cached[key]
