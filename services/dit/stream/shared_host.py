"""Host memory every rank of a group maps: the staged teacher's hand-overs without copying them through a socket.

A region is a file in `/dev/shm` that the group's first rank creates, every rank maps (`torch.from_file`, shared)
and the first rank unlinks once all have mapped it, so nothing outlives the processes. On a GPU the mapping is
page-locked with `cudaHostRegister`, so copies to and from the device run at DMA speed. A rank writes a tensor into
the region and tells the others with a one-element broadcast on the group; they read it from their own mapping.
Who may write when is the caller's business (`teacher.AudioTeacher._hand_over`). Knows nothing about models.
"""

from __future__ import annotations

import itertools
import logging
import os
import pathlib
import tempfile

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

SHARED_DIR = pathlib.Path("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
"""Where the regions' files live (for the moment between their creation and their unlinking)."""
_MIB = 1 << 20
_MIN_CAPACITY = 16 * _MIB
"""Smallest region: any hand-over of the full preset's teacher fits (10.7 MB at the 512-token bucket), so a region
is mapped once, at the service's warm-up, and never grows while serving."""
_names = itertools.count()


class SharedHostRegion:
    """One region of host memory mapped by every rank of `group`; it grows (collectively) to the largest view asked."""

    def __init__(self, group: "dist.ProcessGroup", rank: int, device: torch.device, tag: str):
        self.group, self.rank, self.device, self.tag = group, rank, device, tag
        self._bytes: torch.Tensor | None = None  # uint8 [capacity] over the mapping
        self._registered = False

    @property
    def capacity(self) -> int:
        return 0 if self._bytes is None else self._bytes.numel()

    def view(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A `shape` `dtype` tensor over the start of the region. Growing it is a collective: every rank must ask
        for the same views in the same order (they do: every rank runs the same hand-overs)."""
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        if nbytes > self.capacity:
            self._map(max(_MIN_CAPACITY, -(-nbytes // _MIB) * _MIB))
        return self._bytes[:nbytes].view(dtype).view(shape)

    def _map(self, capacity: int) -> None:
        """Replace the mapping with a new file of `capacity` bytes that every rank maps."""
        self.close()
        path = [None]  # the file's path, or why the first rank could not make it (every rank then raises)
        if self.rank == 0:
            name = str(SHARED_DIR / f"vitascope-{self.tag}-{os.getpid()}-{next(_names)}")
            try:
                with open(name, "wb") as f:
                    f.truncate(capacity)
                path[0] = name
            except OSError as exc:
                path[0] = OSError(f"{self.tag}: cannot make a {capacity >> 20} MiB region in {SHARED_DIR}: {exc}")
        dist.broadcast_object_list(path, group=self.group, group_src=0)
        if isinstance(path[0], OSError):
            raise path[0]
        try:
            self._bytes = torch.from_file(path[0], shared=True, size=capacity, dtype=torch.uint8)
        finally:
            dist.barrier(group=self.group)  # every rank has mapped it (or failed): the name can go
            if self.rank == 0:
                os.unlink(path[0])
        if self.device.type == "cuda":
            err = torch.cuda.cudart().cudaHostRegister(self._bytes.data_ptr(), capacity, 1)  # 1: portable
            self._registered = int(err) == 0
            if not self._registered:  # still correct, only slower: copies go through a pinned bounce buffer
                log.warning("%s: cudaHostRegister of %d bytes of shared memory failed (%s)", self.tag, capacity, err)
        log.info("%s: %.0f MiB of host memory shared by the group", self.tag, capacity / _MIB)

    def close(self) -> None:
        """Unmap the region (after un-registering it from CUDA)."""
        if self._bytes is not None and self._registered:
            torch.cuda.cudart().cudaHostUnregister(self._bytes.data_ptr())
        self._bytes, self._registered = None, False
