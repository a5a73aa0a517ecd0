"""A host-memory tier under the GPU prefix cache: evicted blocks go to host RAM and come back on a hit.

The tier is a second `BlockPool` whose blocks live in one host tensor laid out block-major,
`[num_host_blocks, num_layers, 2 (K, V), block_size, num_kv_heads, head_dim]`, so one host block
is one contiguous run of bytes holding a GPU block of every layer (one copy per block).

Life of a block:
  1. The GPU pool evicts a cached block (its hash is about to be dropped and the block reused):
     `offload` takes a host block for the same hash from the host pool (evicting there with the
     host pool's own policy: LRU, or the tenants' score and `hostKvCacheShare` shards) and queues
     the copy. The host block stays referenced and unhashed, so unfindable, until its copy is done.
  2. At the start of the next step (`run_transfers`, called by the runner before the forward, so
     before any step can overwrite the GPU block) the step's evictions are copied out in one batch:
     on CUDA gathered on the compute stream into a staging tensor, then copied to pinned memory on
     the tier's offload stream; a CUDA event marks completion. The step loop never waits on it: `poll`
     finds fired events and only then makes the host block findable under its hash.
  3. `KVCacheManager.find_prefix` continues the GPU hit run with host hits. `allocate` references
     the host blocks (so the evictions its own allocation causes cannot take them), takes fresh GPU
     blocks for those positions and queues the copy back (`onload`). `run_transfers` copies host
     to a device staging tensor on the tier's onload stream, which does not wait for the step in
     flight (the copy overlaps it); the compute stream waits on an event (no host sync) and
     scatters it into the cache before the forward. The sequence's
     `num_computed_tokens` covers the onloaded tokens; the GPU blocks are hashed again once the
     step has run, like any computed block.

Within a step offloads run before onloads: a GPU block evicted for an onload is read (gathered,
on the compute stream) before it is overwritten (scattered, later on the same stream). Host
blocks are only handed over once a copy's event fired: an offloaded block becomes findable, an
onloaded one is released (and may be evicted and written again) only after `poll` saw its copy
complete, so the two streams never touch the same host block at once.
On CPU the same code runs with ordinary memory and synchronous copies, so tests cover the logic.

Hashes are the GPU cache's (tenant salt and LoRA name included), so a host block is only ever
found by prompts of the tenant, adapter and prefix that computed it.

An fp8 cache's blocks are kept as their bytes (uint8: torch has no fp8 index ops on CPU); they mean
the same when they come back because the cache's per-head scales never change after start-up.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import weakref
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from sits.runtime.config import CacheConfig, ConfigError
from sits.runtime.engine.block_pool import BlockPool
from sits.runtime.engine.cache_sizing import GIB, KVShape
from sits.runtime.engine.eviction import BlockOwner, EvictionPolicy, KVBlock
from sits.runtime.engine.prefix_hash import BlockHash

logger = logging.getLogger(__name__)

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class HostTierStats:
    """The host tier's state and cumulative transfer figures (a metrics snapshot).

    Attributes:
        blocks_total: host blocks in the tier.
        blocks_cached: host blocks findable by hash.
        blocks_by_tenant: host blocks each tenant holds (cached or being written).
        offload_blocks, offload_bytes, offload_seconds: GPU -> host copies completed (seconds of
            copy time measured on the device, summed over batches).
        onload_blocks, onload_bytes, onload_seconds: host -> GPU copies completed.
        dropped_blocks: evicted GPU blocks not kept (the tenant's host share refused a block).
    """

    blocks_total: int = 0
    blocks_cached: int = 0
    blocks_by_tenant: dict[str, int] = field(default_factory=dict)
    offload_blocks: int = 0
    offload_bytes: int = 0
    offload_seconds: float = 0.0
    onload_blocks: int = 0
    onload_bytes: int = 0
    onload_seconds: float = 0.0
    dropped_blocks: int = 0


@dataclass
class _Transfer:
    """One batch of copies in flight (CUDA) or just done (CPU)."""

    offload: bool
    host_blocks: list[KVBlock]
    hashes: list[BlockHash | None]
    nbytes: int
    done: Any = None  # torch.cuda.Event recorded after the copies, None on CPU
    start: Any = None  # torch.cuda.Event recorded before them (timing)
    seconds: float = 0.0  # measured copy time on CPU
    keep_alive: list[torch.Tensor] = field(default_factory=list)  # staging tensors the copies read


def _storage_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype host blocks are kept in: the cache's, or uint8 (its bytes) for an fp8 cache."""
    return torch.uint8 if dtype == torch.float8_e4m3fn else dtype


def _as_stored(cache: torch.Tensor) -> torch.Tensor:
    """A GPU cache tensor viewed in `_storage_dtype` (no copy)."""
    return cache.view(_storage_dtype(cache.dtype))


def host_blocks_for_gb(gb: float, shape: KVShape, block_size: int) -> int:
    """How many host blocks fit in `gb` GiB (each holds one GPU block of every layer)."""
    return int(gb * GIB) // shape.bytes_per_block(block_size)


def build_host_tier(cache: CacheConfig, shape: KVShape, device: torch.device,
                    eviction_policy: EvictionPolicy | Callable[[int], EvictionPolicy] | None = None
                    ) -> HostKVTier | None:
    """The tier `--host-kv-cache-gb` asks for (None when 0); `eviction_policy` may be a factory
    taking the number of host blocks (the tenancy layer's, for `hostKvCacheShare`)."""
    if cache.host_kv_cache_gb <= 0:
        return None
    num_blocks = host_blocks_for_gb(cache.host_kv_cache_gb, shape, cache.block_size)
    if num_blocks < 1:
        raise ConfigError(f"--host-kv-cache-gb {cache.host_kv_cache_gb:g} holds no KV block "
                          f"({shape.bytes_per_block(cache.block_size)} bytes each); give at least that much")
    if eviction_policy is not None and not isinstance(eviction_policy, EvictionPolicy):
        eviction_policy = eviction_policy(num_blocks)
    return HostKVTier(num_blocks, shape, cache.block_size, device, eviction_policy)


def gpu_numa_node(device: torch.device) -> int | None:
    """The NUMA node the platform reports for a CUDA device's PCI slot, or None if it says none."""
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    bus = getattr(props, "pci_bus_id", None)
    if bus is None:
        return None
    address = f"{getattr(props, 'pci_domain_id', 0):04x}:{bus:02x}:{getattr(props, 'pci_device_id', 0):02x}.0"
    try:
        node = int(Path(f"/sys/bus/pci/devices/{address}/numa_node").read_text().strip())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def _node_cpus(node: int) -> set[int]:
    """CPUs of a NUMA node from sysfs, empty when unknown."""
    try:
        return parse_cpulist(Path(f"/sys/devices/system/node/node{node}/cpulist").read_text())
    except (OSError, ValueError):
        return set()


def parse_cpulist(text: str) -> set[int]:
    """A kernel CPU list (`0-7,16-23`, `3`, empty) as a set of CPU numbers."""
    cpus: set[int] = set()
    for part in filter(None, text.strip().split(",")):
        low, _, high = part.partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    return cpus


def _allocate_host_buffer(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The tier's memory: ordinary memory for a CPU engine; for a CUDA device, page-locked with
    cudaHostRegister (exactly its size: torch's pinned allocator would round 72 GiB up to 128) and
    first touched on the GPU's NUMA node when the platform names one and this process may run there.
    The caller unregisters it (`_unregister`) before the memory is freed."""
    if device.type != "cuda":
        return torch.zeros(shape, dtype=dtype)
    node = gpu_numa_node(device)
    cpus = _node_cpus(node) if node is not None else set()
    previous = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
    bind = cpus & previous
    if bind:
        os.sched_setaffinity(0, bind)  # pages are placed where they are first touched (pinning touches them)
    try:
        buffer = torch.empty(shape, dtype=dtype)
        nbytes = buffer.numel() * buffer.element_size()
        error = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), nbytes, 0)
        if int(error) != 0:
            raise RuntimeError(f"cannot pin {nbytes / GIB:.1f} GiB of host memory for the host KV tier "
                               f"(cudaHostRegister error {int(error)}); lower --host-kv-cache-gb")
    finally:
        if bind:
            os.sched_setaffinity(0, previous)
    logger.info("host KV tier: %.1f GiB pinned on NUMA node %s", nbytes / GIB,
                node if bind else "unknown (the platform names none, or this process may not run there)")
    return buffer


def _unregister(pointer: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(pointer)


class HostKVTier:
    """The host tier's blocks (bookkeeping), its memory and the copies between it and the GPU cache.

    Args:
        num_blocks: host blocks (`host_blocks_for_gb`).
        shape: the GPU cache's geometry (layers, KV heads, head dim, dtype).
        block_size: tokens per block.
        device: the GPU cache's device; CUDA gets pinned memory and a copy stream per direction.
        eviction_policy: orders the host tier's evictable blocks (LRU by default; the tenancy
            layer's `host_tenant_eviction_policy` for scores and `hostKvCacheShare` shards).
    """

    def __init__(self, num_blocks: int, shape: KVShape, block_size: int, device: torch.device,
                 eviction_policy: EvictionPolicy | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"the host KV tier needs at least one block, got {num_blocks}")
        self.pool = BlockPool(num_blocks, True, eviction_policy)
        self.block_size = block_size
        self.device = torch.device(device)
        self.bytes_per_block = shape.bytes_per_block(block_size)
        self.buffer = _allocate_host_buffer(
            (num_blocks, shape.num_layers, 2, block_size, shape.num_kv_heads, shape.head_dim),
            _storage_dtype(shape.dtype), self.device)
        self._cuda = self.device.type == "cuda"
        if self._cuda:  # unpin before the tensor's memory goes back (weakref callbacks run first)
            weakref.finalize(self, _unregister, self.buffer.data_ptr())
        # One stream per direction: an onload never waits behind the compute stream's step in
        # flight (an offload must: it copies what the compute stream gathered).
        self._offload_stream = torch.cuda.Stream(self.device) if self._cuda else None
        self._onload_stream = torch.cuda.Stream(self.device) if self._cuda else None
        self._offloads: list[tuple[int, KVBlock, BlockHash]] = []  # (gpu block id, host block, hash)
        self._onloads: list[tuple[KVBlock, int]] = []  # (host block, gpu block id)
        self._in_flight: list[_Transfer] = []
        self._pending: set[BlockHash] = set()  # hashes being offloaded (not findable yet)
        self._counts: Counter[str] = Counter()
        self._seconds = {"offload": 0.0, "onload": 0.0}
        logger.info("host KV tier: %d blocks x %d tokens (%.2f GiB, %s)", num_blocks, block_size,
                    num_blocks * self.bytes_per_block / GIB, "pinned" if self._cuda else "host memory")

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    # -- the KV-cache manager's side (scheduling, no tensors) -----------------------------------

    def lookup(self, block_hash: BlockHash) -> KVBlock | None:
        """The host block holding this prefix hash, once its copy from the GPU has completed."""
        return self.pool.lookup(block_hash)

    def holder_of(self, block: KVBlock) -> str | None:
        return self.pool.holder_of(block)

    def offload(self, gpu_block: KVBlock, holder: str | None) -> None:
        """The GPU pool is evicting `gpu_block` (still hashed, K/V still intact until the next
        step runs): keep a copy under its hash, unless the host tier already has it or the
        holder's host share refuses a block. The host block is charged to `holder` and keeps the
        GPU block's last use (`KVBlock.last_used_time`: its last owner's request)."""
        block_hash = gpu_block.block_hash
        if block_hash is None or block_hash in self._pending or self.pool.lookup(block_hash) is not None:
            return
        last = gpu_block.last_owner or BlockOwner(request_id="")
        taken = self.pool.allocate(1, dataclasses.replace(last, tenant=holder or last.tenant))
        if taken is None:
            self._counts["dropped"] += 1
            return
        self._pending.add(block_hash)
        self._offloads.append((gpu_block.block_id, taken[0], block_hash))

    def hold(self, host_blocks: Sequence[KVBlock], owner: BlockOwner) -> None:
        """Reference host hits so no eviction takes them before their copy back is queued."""
        self.pool.touch(host_blocks, owner)

    def unhold(self, host_blocks: Sequence[KVBlock]) -> None:
        """Drop `hold`'s references (the allocation failed)."""
        self.pool.release(reversed(host_blocks))

    def onload(self, host_blocks: Sequence[KVBlock], gpu_block_ids: Sequence[int]) -> None:
        """Queue the copy of held host blocks into these GPU blocks for the next step; the host
        blocks are released once the copy has completed."""
        if len(host_blocks) != len(gpu_block_ids):
            raise ValueError(f"{len(host_blocks)} host blocks for {len(gpu_block_ids)} GPU blocks")
        self._onloads.extend(zip(host_blocks, gpu_block_ids, strict=True))

    def reset(self) -> int:
        """Forget every evictable host block's hash; returns how many."""
        return self.pool.reset_prefix_cache()

    # -- the runner's side (tensors) -------------------------------------------------------------

    @torch.inference_mode()
    def run_transfers(self, kv_caches: KVCaches) -> None:
        """Queue this step's copies (call before the step's forward): offloads, then onloads.

        On CUDA nothing here waits for the device: the compute stream only waits (on the device)
        for the onload copies it is about to read.
        """
        self.poll()
        if self._offloads:
            offloads, self._offloads = self._offloads, []
            self._run_offload(kv_caches, offloads)
        if self._onloads:
            onloads, self._onloads = self._onloads, []
            self._run_onload(kv_caches, onloads)
        if not self._cuda:
            self.poll()

    def poll(self) -> None:
        """Finish the batches whose copies completed: offloaded blocks become findable, onloaded
        host blocks are released. Never blocks."""
        finished: list[_Transfer] = []
        waiting: list[_Transfer] = []
        for transfer in self._in_flight:  # one query each; two streams: batches complete out of order
            (finished if transfer.done is None or transfer.done.query() else waiting).append(transfer)
        self._in_flight = waiting
        for transfer in finished:
            kind = "offload" if transfer.offload else "onload"
            seconds = transfer.seconds if transfer.done is None else transfer.start.elapsed_time(transfer.done) / 1e3
            self._seconds[kind] += seconds
            self._counts[f"{kind}_blocks"] += len(transfer.host_blocks)
            self._counts[f"{kind}_bytes"] += transfer.nbytes
            for block, block_hash in zip(transfer.host_blocks, transfer.hashes, strict=True):
                if block_hash is not None:
                    self._pending.discard(block_hash)
                    self.pool.cache(block, block_hash)  # a duplicate of a hash already here stays private
            self.pool.release(reversed(transfer.host_blocks))

    def synchronize(self) -> None:
        """Wait for every queued copy and finish it (tests, shutdown)."""
        for stream in (self._offload_stream, self._onload_stream):
            if stream is not None:
                stream.synchronize()
        self.poll()

    def _run_offload(self, kv_caches: KVCaches, offloads: list[tuple[int, KVBlock, BlockHash]]) -> None:
        gpu_ids = self._device_ids([gpu for gpu, _, _ in offloads])
        host_blocks = [block for _, block, _ in offloads]
        transfer = _Transfer(True, host_blocks, [h for _, _, h in offloads], len(offloads) * self.bytes_per_block)
        started = time.perf_counter()
        # [n, layers, 2, block_size, heads, dim]: gathered on the compute stream, in order with the steps
        staging = torch.stack([torch.stack((_as_stored(k).index_select(0, gpu_ids),
                                            _as_stored(v).index_select(0, gpu_ids)), 1)
                               for k, v in kv_caches], 1)
        if self._offload_stream is None:
            host_ids = torch.tensor([b.block_id for b in host_blocks], dtype=torch.long)
            self.buffer.index_copy_(0, host_ids, staging)
            transfer.seconds = time.perf_counter() - started
        else:
            transfer.start, transfer.done = _timed_events()
            self._offload_stream.wait_stream(torch.cuda.current_stream(self.device))  # after the gather
            with torch.cuda.stream(self._offload_stream):
                transfer.start.record()
                for first, index, count in _runs([b.block_id for b in host_blocks]):
                    self.buffer[first:first + count].copy_(staging[index:index + count], non_blocking=True)
                transfer.done.record()
            staging.record_stream(self._offload_stream)
            transfer.keep_alive.append(staging)
        self._in_flight.append(transfer)

    def _run_onload(self, kv_caches: KVCaches, onloads: list[tuple[KVBlock, int]]) -> None:
        host_blocks = [block for block, _ in onloads]
        gpu_ids = self._device_ids([gpu for _, gpu in onloads])
        transfer = _Transfer(False, host_blocks, [None] * len(host_blocks), len(onloads) * self.bytes_per_block)
        started = time.perf_counter()
        if self._onload_stream is None:
            staging = self.buffer.index_select(0, torch.tensor([b.block_id for b in host_blocks], dtype=torch.long))
        else:
            transfer.start, transfer.done = _timed_events()
            compute = torch.cuda.current_stream(self.device)
            # Allocated on the onload stream, so the copy need not wait for the compute stream's
            # step in flight (it overlaps it); the compute stream then reads it (record_stream).
            with torch.cuda.stream(self._onload_stream):
                staging = torch.empty((len(onloads), *self.buffer.shape[1:]), dtype=self.buffer.dtype,
                                      device=self.device)
                transfer.start.record()
                for first, index, count in _runs([b.block_id for b in host_blocks]):
                    staging[index:index + count].copy_(self.buffer[first:first + count], non_blocking=True)
                transfer.done.record()
            compute.wait_event(transfer.done)  # a device-side wait: the host goes on
            staging.record_stream(compute)
        for layer, (k, v) in enumerate(kv_caches):
            _as_stored(k).index_copy_(0, gpu_ids, staging[:, layer, 0])
            _as_stored(v).index_copy_(0, gpu_ids, staging[:, layer, 1])
        if self._onload_stream is None:
            transfer.seconds = time.perf_counter() - started
        self._in_flight.append(transfer)

    def _device_ids(self, ids: list[int]) -> torch.Tensor:
        """Block ids as an int64 tensor on the cache's device, without a host sync (a pinned
        staging copy: a pageable one would wait for the step in flight)."""
        host = torch.tensor(ids, dtype=torch.long)
        return host.pin_memory().to(self.device, non_blocking=True) if self._cuda else host

    # -- observation -----------------------------------------------------------------------------

    def stats(self) -> HostTierStats:
        """The snapshot (call on the engine's thread, like the scheduler's stats)."""
        return HostTierStats(
            blocks_total=self.pool.num_blocks,
            blocks_cached=self.pool.num_cached_blocks,
            blocks_by_tenant=self.pool.held_blocks_by_tenant(),
            offload_blocks=self._counts["offload_blocks"],
            offload_bytes=self._counts["offload_bytes"],
            offload_seconds=self._seconds["offload"],
            onload_blocks=self._counts["onload_blocks"],
            onload_bytes=self._counts["onload_bytes"],
            onload_seconds=self._seconds["onload"],
            dropped_blocks=self._counts["dropped"],
        )


def _timed_events() -> tuple[Any, Any]:
    return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)


def _runs(host_ids: list[int]) -> list[tuple[int, int, int]]:
    """Runs of consecutive host block ids: (first host id, index in the batch, length), so
    neighbouring blocks go in one copy."""
    runs: list[tuple[int, int, int]] = []
    for index, host_id in enumerate(host_ids):
        if runs and runs[-1][0] + runs[-1][2] == host_id and runs[-1][1] + runs[-1][2] == index:
            first, start, count = runs[-1]
            runs[-1] = (first, start, count + 1)
        else:
            runs.append((host_id, index, 1))
    return runs
