"""How much memory this process can still allocate: what every command checks before anything large is built
(`analysis.footprint` for the analysis commands' sizes, `conversion` for a checkpoint's tensors)."""

from __future__ import annotations

from pathlib import Path

import torch


def available_memory(device: str) -> tuple[int, str] | None:
    """(bytes this process can still allocate on `device`, where the number comes from), None where unknown: on a
    GPU what it has free, on the CPU the smaller of the system's available memory and this cgroup's limit."""
    if device.startswith("cuda"):
        return torch.cuda.mem_get_info(torch.device(device))[0], f"free on {device}"
    found = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append((int(line.split()[1]) * 1024, "MemAvailable"))
    except (OSError, ValueError, IndexError):
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            found.append((max(0, int(limit) - used), "this cgroup's memory.max"))
    except (OSError, ValueError):
        pass
    try:  # an address-space cap (`ulimit -v`, resource.setrlimit): what this process has mapped counts against it
        import resource  # not on Windows

        cap = resource.getrlimit(resource.RLIMIT_AS)[0]
        if cap != resource.RLIM_INFINITY:
            status = Path("/proc/self/status").read_text()
            mapped = int(next(line for line in status.splitlines() if line.startswith("VmSize:")).split()[1]) * 1024
            found.append((max(0, cap - mapped), "the RLIMIT_AS of this process"))
    except (OSError, ValueError, StopIteration):
        pass
    return min(found) if found else None
