"""NUMA placement of the host slabs: find the GPU's node through sysfs, and
allocate while this thread's CPU affinity and memory policy point at it.

Pinned state on the far socket crosses the inter-socket link on every copy;
on one-node hosts there is nothing to choose and binding is a logged no-op.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

SYSFS_ROOT = Path("/sys")


def parse_cpulist(text: str) -> list[int]:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11] (the kernel's cpulist format)."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        cpus.extend(range(int(first), int(last or first) + 1))
    return cpus


def numa_nodes(sysfs: Path = SYSFS_ROOT) -> list[int]:
    """The host's NUMA nodes, from /sys/devices/system/node/node<N>."""
    node_dir = sysfs / "devices/system/node"
    if not node_dir.is_dir():
        return []
    names = (p.name for p in node_dir.iterdir())
    return sorted(int(n[4:]) for n in names if n.startswith("node") and n[4:].isdigit())


def pci_numa_node(pci_bus_id: str, sysfs: Path = SYSFS_ROOT) -> int | None:
    """The node a PCI device hangs off ('0000:3b:00.0'), or None if sysfs does not say."""
    path = sysfs / "bus/pci/devices" / pci_bus_id.lower() / "numa_node"
    try:
        node = int(path.read_text().strip())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def node_cpus(node: int, sysfs: Path = SYSFS_ROOT) -> list[int]:
    return parse_cpulist((sysfs / f"devices/system/node/node{node}/cpulist").read_text())


def cuda_pci_bus_id(device: torch.device) -> str:
    props = torch.cuda.get_device_properties(device)
    return f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"


def device_numa_node(device: torch.device, sysfs: Path = SYSFS_ROOT) -> int | None:
    """The NUMA node to hold `device`'s host state, or None when there is no choice."""
    if device.type != "cuda" or len(numa_nodes(sysfs)) < 2:
        return None
    return pci_numa_node(cuda_pci_bus_id(device), sysfs)


@contextlib.contextmanager
def bound_to_node(node: int | None, sysfs: Path = SYSFS_ROOT) -> Iterator[None]:
    """Run the body with CPU affinity and preferred memory on `node`.

    The affinity stays afterwards (the thread that drives the GPU belongs next
    to it); the memory policy goes back to local allocation, so later host
    allocations (activations offload, data loading) are not steered.
    """
    if node is None:
        logger.info("offload: one NUMA node (or unknown); host state is not bound")
        yield
        return
    cpus = node_cpus(node, sysfs)
    os.sched_setaffinity(0, cpus)
    libnuma = _libnuma()
    if libnuma is None:
        logger.info("offload: libnuma unavailable; bound CPUs to node %d, memory unbound", node)
        yield
        return
    memory, schedule = libnuma
    # Preferred, not strict: a full node spills to the next instead of failing the run.
    schedule.set_preferred_node(node)
    logger.info("offload: host state on NUMA node %d (cpus %s)", node, cpus)
    try:
        yield
    finally:
        memory.set_local_alloc()


def _libnuma() -> tuple[ModuleType, ModuleType] | None:
    try:
        from numa import memory, schedule  # py-libnuma: ctypes over libnuma.so.1
    except (ImportError, OSError):
        return None
    return memory, schedule
