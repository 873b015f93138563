"""The weights a decode step streams, gathered into one arena on transparent huge pages (Linux, CPU).

Knows Linux's transparent huge pages (the mode in /sys/kernel/mm/transparent_hugepage/enabled, madvise
MADV_HUGEPAGE, AnonHugePages in /proc/self/smaps) and torch's Tensor.set_, which moves a tensor onto other
storage in place, so every holder of it (the decoder's projections, the one-call int4 step) reads the arena
without being told. Does not know models: the engine says which tensors.

Why: a decode step reads every weight once, as long sequential streams. On 4 KB pages a CPU's stream prefetcher
stops at each page boundary and every page is a TLB miss; on 2 MB pages it runs on. Measured on a 2-core AVX-512
EPYC (one thread, 64 int4 matrices of 3072 x 576, 62 MB, side by side): the int4 kernel read 12.5 GB/s from
separate 4 KB-page tensors and 20.4 GB/s from one huge-page arena (tensor.sum() on the machine: 26 / 29 GB/s).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # linux/mman.h
ALIGN = 64  # each storage starts on a cache line
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")

# NOTE: arena storages by (data pointer, size) -> the bytes their tensors span: measure.tensor_storage_bytes counts an
# arena by what it holds, not by its slack (up to 4 MB never touched, so never resident)
_arena_bytes: dict[tuple[int, int], int] = {}


@dataclass(frozen=True)
class Arena:
    num_bytes: int  # the storages gathered, each once, with their alignment
    num_tensors: int
    huge_page_bytes: int  # the huge pages backing the arena now (AnonHugePages in /proc/self/smaps), whole pages
    mode: str  # the transparent huge pages mode: always | madvise
    buffer: torch.Tensor = field(repr=False)  # the arena; its registry entry goes with it


def huge_pages_mode(path: Path = THP_ENABLED) -> str | None:
    """The bracketed choice of Linux's transparent huge pages ('always', 'madvise', 'never'), or None where
    there is no such setting (not Linux, not readable)."""
    try:
        text = path.read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def arena_bytes(storage: torch.UntypedStorage) -> int | None:
    """The bytes an arena's tensors span, or None when the storage is not an arena."""
    return _arena_bytes.get((storage.data_ptr(), storage.nbytes()))


def gather_on_huge_pages(tensors: list[torch.Tensor], sharing: list[torch.Tensor] = ()) -> Arena | None:
    """Move these tensors (CPU, strided; several may share a storage) into one arena advised onto huge pages,
    each storage copied once and every tensor set onto its copy in place; so is each tensor of `sharing` that
    shares one of their storages (a tied embedding, transformers' parameter the decoder reads in place), or the
    old storage would stay alive beside its copy. -> what was done, or None where nothing was (no huge pages
    here, no such tensors). The old storages are freed when nothing else holds them."""
    mode = huge_pages_mode()
    if mode not in ("always", "madvise"):
        log.info("weights stay on the default pages: transparent huge pages are %s", mode or "not available")
        return None
    groups: dict[int, tuple[torch.UntypedStorage, list[torch.Tensor]]] = {}
    for t in tensors:
        if t.device.type != "cpu" or t.layout != torch.strided or t.untyped_storage().nbytes() == 0:
            continue
        storage = t.untyped_storage()
        entry = groups.setdefault(storage.data_ptr(), (storage, []))
        if not any(t is seen for seen in entry[1]):
            entry[1].append(t)
    if not groups:
        return None
    for t in sharing:
        if t.device.type == "cpu" and t.layout == torch.strided and t.untyped_storage().data_ptr() in groups:
            members = groups[t.untyped_storage().data_ptr()][1]
            if not any(t is seen for seen in members):
                members.append(t)
    offsets, total = {}, 0
    for ptr, (storage, _) in groups.items():
        offsets[ptr] = total
        total += -(-storage.nbytes() // ALIGN) * ALIGN
    span = -(-total // HUGE_PAGE) * HUGE_PAGE
    buffer = _fresh_pages(span + HUGE_PAGE)
    start = -buffer.data_ptr() % HUGE_PAGE
    if _madvise(buffer.data_ptr() + start, span) != 0:
        log.info("weights stay on the default pages: madvise(MADV_HUGEPAGE) was refused (errno %d)", ctypes.get_errno())
        return None
    target = buffer.untyped_storage()
    with torch.inference_mode():  # NOTE: the decoder's tensors may be inference tensors; set_ is in place either way
        for ptr, (storage, members) in groups.items():
            at = start + offsets[ptr]
            buffer[at:at + storage.nbytes()].copy_(torch.empty(0, dtype=torch.uint8).set_(storage))
            for t in members:
                t.set_(target, at // t.element_size() + t.storage_offset(), t.size(), t.stride())
    key = (target.data_ptr(), target.nbytes())
    _arena_bytes[key] = total
    weakref.finalize(buffer, _arena_bytes.pop, key, None)
    on_huge_pages = min(resident_huge_page_bytes(buffer.data_ptr() + start), span)
    arena = Arena(total, sum(len(m) for _, m in groups.values()), on_huge_pages, mode, buffer)
    log.info("weights a step reads gathered into one %.1f MB arena (%d tensors), on %d huge pages of 2 MB",
             arena.num_bytes / 1e6, arena.num_tensors, arena.huge_page_bytes // HUGE_PAGE)
    return arena


def _fresh_pages(num_bytes: int) -> torch.Tensor:
    """num_bytes of memory no one has touched yet, as a uint8 tensor (which keeps the mapping alive): a private
    anonymous mapping of its own. NOTE: not torch.empty: glibc serves a few MB from its heap once larger blocks have
    been freed (its mmap threshold rises), memory already faulted in on 4 KB pages, which MADV_HUGEPAGE does not
    replace at once: such an arena came out on no huge page at all."""
    # NOTE: private: a shared anonymous mapping is shmem, whose huge pages have a setting of their own (off by default)
    pages = mmap.mmap(-1, num_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(pages, dtype=torch.uint8)


def resident_huge_page_bytes(address: int, smaps: Path = Path("/proc/self/smaps")) -> int:
    """AnonHugePages of the mapping holding `address` (0 where /proc/self/smaps cannot be read)."""
    try:
        lines = smaps.read_text().splitlines()
    except OSError:
        return 0
    inside = False
    for line in lines:
        head = line.split(maxsplit=1)[0] if line else ""
        if "-" in head and not head.endswith(":"):
            low, _, high = head.partition("-")
            try:
                inside = int(low, 16) <= address < int(high, 16)
            except ValueError:
                inside = False
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
    return 0


def _madvise(address: int, length: int) -> int:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return -1
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), MADV_HUGEPAGE)
