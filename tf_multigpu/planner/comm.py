"""Collective algorithms as transfers, and topologies as links: the time of a collective.

An algorithm turns one collective (all-reduce or all-gather of `nbytes` over a group of
devices) into phases of point-to-point transfers (src, dst, bytes); a phase ends when its
slowest link is done. A topology maps each transfer onto the links it crosses; every link
has a bandwidth, and a link carrying k transfers in one phase takes k times as long. So the
same algorithm costs differently on different machines, and concurrent groups (the B
model-parallel groups of a hybrid mesh exchanging activations at once) share what they share.

Algorithms (`--all_reduce` names in brackets):
- ring [auto on CPU: CollectiveReduceV2's ring; nccl]: all-reduce = reduce-scatter + all-gather,
  2(n-1) phases of nbytes/n from each device to the next; all-gather n-1 phases.
- one_device [one_device] (a star, or a parameter server): every other device sends its whole
  tensor to the first, which sends the result back to all (tf.distribute.ReductionToOneDevice).
- hierarchical_copy [hierarchical_copy]: TensorFlow's HierarchicalCopyAllReduce for the
  DGX-1: reduce each half of the devices to its first device, exchange between the two, then
  broadcast within each half (cross_device_utils.aggregate_gradients_using_hierarchical_copy).
- reduce_scatter (an op, always a ring): the backward of an all-gather where each device
  needs only its shard of the summed input gradient, as a native model-parallel
  implementation does (profiling/analytic.py's minimum); DTensor all-reduces instead.
- padded_all_reduce: how DTensor lowers an all-gather on CPU (BUILD_NOTES, profiling/
  collectives.py): a ring all-reduce of the whole zero-padded buffer, 2(n-1)/n of it per device
  instead of (n-1)/n.

Topologies (`DeviceProfile.topology`):
- ring: each device has its own link out and in (the "bus bandwidth" of a ring collective);
  nothing else is shared. Measured profiles use it: their bandwidth is what a ring achieved.
- host: every copy crosses the host's root complex, one link shared by all copies (2013
  servers without peer-to-peer between GPUs: copies are staged through host memory).
- pcie_switch: devices in groups of `devices_per_switch` behind a PCIe switch; copies inside
  a switch go peer to peer, copies between switches also cross the shared root complex.
- nvlink: all-to-all, a dedicated link for every ordered pair of devices.
- hybrid_cube_mesh: DGX-1's NVLink: devices 0-3 and 4-7 fully connected, and i <-> i+4;
  a transfer between devices with no direct link is relayed by a common neighbour. Rings are
  laid out on direct links where one exists (NCCL's ring search does the same).
"""

from __future__ import annotations

import functools
import itertools

ALGORITHMS = ("ring", "one_device", "hierarchical_copy", "padded_all_reduce")
TOPOLOGIES = ("ring", "host", "pcie_switch", "nvlink", "hybrid_cube_mesh")
# tf-multigpu-train's --all_reduce values (config.ALL_REDUCE, the one list both entry points
# accept; a test keeps the two in step) as the planner's algorithms (auto: the profile's default).
FLAG_ALGORITHM = {"auto": "", "nccl": "ring", "one_device": "one_device", "hierarchical_copy": "hierarchical_copy"}


def _cube_mesh_neighbours(a: int, b: int) -> bool:
    return a != b and (a // 4 == b // 4 or abs(a - b) == 4)


@functools.lru_cache(maxsize=256)
def _ordered(group: tuple, topology: str) -> tuple:
    """The ring order of `group`: on a cube mesh, one that uses direct links only, if any."""
    if topology != "hybrid_cube_mesh" or len(group) < 3:
        return group
    for rest in itertools.permutations(group[1:]):
        ring = (group[0],) + rest
        if all(_cube_mesh_neighbours(ring[i], ring[(i + 1) % len(ring)]) for i in range(len(ring))):
            return ring
    return group


def schedule(algorithm: str, op: str, group, nbytes: float, topology: str = "ring") -> list[list[tuple]]:
    """Phases of (src, dst, bytes) transfers of one collective over the devices `group`."""
    group = _ordered(tuple(group), topology)
    n = len(group)
    if n < 2 or nbytes <= 0:
        return []
    if algorithm == "padded_all_reduce":
        algorithm, op = "ring", "all_reduce"
    if algorithm == "ring":   # an all-gather and a reduce-scatter are each half of an all-reduce
        step = [(group[i], group[(i + 1) % n], nbytes / n) for i in range(n)]
        return [step] * (2 * (n - 1) if op == "all_reduce" else n - 1)
    if algorithm == "one_device":
        root, others = group[0], group[1:]
        gather = nbytes if op == "all_reduce" else nbytes / n   # the whole tensor, or each device's piece
        return [[(d, root, gather) for d in others], [(root, d, nbytes) for d in others]]
    if op == "reduce_scatter":
        return schedule("ring", op, group, nbytes, topology)
    if algorithm == "hierarchical_copy":
        if op != "all_reduce":
            return schedule("ring", op, group, nbytes, topology)
        half = max(n // 2, 1)
        parts = [group[:half], group[half:]]
        masters = [p[0] for p in parts]
        reduce_in = [(d, p[0], nbytes) for p in parts for d in p[1:]]
        phases = [reduce_in, [(masters[1], masters[0], nbytes)], [(masters[0], masters[1], nbytes)],
                  [(p[0], d, nbytes) for p in parts for d in p[1:]]]
        return [ph for ph in phases if ph]
    raise ValueError(f"unknown algorithm {algorithm!r}: one of {', '.join(ALGORITHMS)}")


def links(profile, src: int, dst: int) -> list[tuple[str, float]]:
    """(link, bandwidth in bytes/s) of every link a copy from `src` to `dst` crosses."""
    bw = profile.link_bandwidth_bytes_per_s
    host = profile.host_bandwidth_bytes_per_s or bw
    return [(name, host if name == "root_complex" else bw)
            for name in _route(profile.topology, profile.devices_per_switch or 1, src, dst)]


@functools.lru_cache(maxsize=4096)
def _route(topology: str, per_switch: int, src: int, dst: int) -> tuple:
    if topology == "ring":
        return (f"out{src}", f"in{dst}")
    if topology == "host":
        return (f"out{src}", f"in{dst}", "root_complex")
    if topology == "pcie_switch":
        if src // per_switch == dst // per_switch:
            return (f"out{src}", f"in{dst}")
        return (f"out{src}", f"in{dst}", f"up{src // per_switch}", f"down{dst // per_switch}", "root_complex")
    if topology == "nvlink":
        return (f"{src}>{dst}",)
    if topology == "hybrid_cube_mesh":
        if _cube_mesh_neighbours(src, dst):
            return (f"{src}>{dst}",)
        relay = next(k for k in range(8) if _cube_mesh_neighbours(src, k) and _cube_mesh_neighbours(k, dst))
        return (f"{src}>{relay}", f"{relay}>{dst}")
    raise ValueError(f"unknown topology {topology!r}: one of {', '.join(TOPOLOGIES)}")


def seconds(profile, algorithm: str, op: str, groups, nbytes: float) -> float:
    """Time of one collective run at once by every group of `groups` (lists of device ids),
    each on its own `nbytes` tensor: per phase, the busiest link's bytes / its bandwidth,
    plus the profile's latency per phase, plus its fixed cost per collective (measured
    profiles: what synchronising devices that share cores costs, whatever the group's size)."""
    total = profile.collective_overhead_s if any(len(g) > 1 for g in groups) else 0.0
    per_group = [schedule(algorithm, op, g, nbytes, profile.topology) for g in groups]
    for phase in itertools.zip_longest(*per_group, fillvalue=[]):
        load, bandwidth = {}, {}
        for transfers in phase:
            for src, dst, size in transfers:
                for link, bw in links(profile, src, dst):
                    load[link] = load.get(link, 0.0) + size
                    bandwidth[link] = bw
        if load:
            total += max(load[k] / bandwidth[k] for k in load) + profile.link_latency_s
    return total


def moved_bytes(algorithm: str, op: str, n: int, nbytes: float) -> float:
    """Bytes one device sends per collective, averaged over the group: what the communication
    report counts (its `moved_bytes`). Ring, star and hierarchical copy all-reduces all move
    2(n-1)/n x nbytes in total per device; they differ in which links carry them."""
    return sum(_sent_by_device(algorithm, op, n, nbytes).values()) / n if n > 1 else 0.0


def busiest_sent_bytes(algorithm: str, op: str, n: int, nbytes: float) -> float:
    """Bytes the device that sends most sends per collective (the communication report's
    `busiest_sent_bytes`): moved_bytes for a ring, where every device sends alike; n-1 whole
    tensors from the root of a star, whose copies back all leave that one device."""
    return max(_sent_by_device(algorithm, op, n, nbytes).values(), default=0.0)


def _sent_by_device(algorithm: str, op: str, n: int, nbytes: float) -> dict:
    """{device: bytes it sends} over all phases of one collective on devices 0..n-1."""
    sent = {}
    for phase in schedule(algorithm, op, range(n), nbytes):
        for src, _, size in phase:
            sent[src] = sent.get(src, 0.0) + size
    return sent
