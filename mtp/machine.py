"""The machine mtp runs on: its name, and the folder of what is measured or converted once on it."""

import json
import os
import platform
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def cache_dir() -> Path:
    """Folder for converted GGUF models and measurements of this machine: `$MTP_CACHE`, else `~/.cache/mtp`."""
    return Path(os.environ.get("MTP_CACHE", Path.home() / ".cache" / "mtp"))


def device_name(device: str | torch.device) -> str:
    """The accelerator's name, or the CPU's model and the threads torch uses on it."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type != "cpu":
        return device.type
    cpuinfo = Path("/proc/cpuinfo")
    names = (
        [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines() if line.startswith("model name")]
        if cpuinfo.is_file()
        else []
    )
    return f"{names[0] if names else platform.processor() or platform.machine()} x{torch.get_num_threads()} threads"


def measured(
    file: str, key: str, measure: Callable[[], Any], again: bool = False, fresh: Callable[[Any], None] | None = None
) -> Any:
    """`measure()` as cached under `key` in `cache_dir() / file` (a JSON object), measured and stored first if it
    is not there yet, or if `again` (then passed to `fresh` too). Processes measuring at once each add their own
    key (the last one's value stays for a key they share)."""
    store = cache_dir() / file
    cached = json.loads(store.read_text()) if store.is_file() else {}
    if again or key not in cached:
        value = measure()
        store.parent.mkdir(parents=True, exist_ok=True)
        cached = json.loads(store.read_text()) if store.is_file() else {}  # what others stored meanwhile
        cached[key] = value
        with tempfile.NamedTemporaryFile("w", dir=store.parent, suffix=".tmp", delete=False) as staging:
            json.dump(cached, staging, indent=1)
        os.replace(staging.name, store)  # written aside, then renamed: never half a file
        if fresh is not None:
            fresh(value)
    return cached[key]
