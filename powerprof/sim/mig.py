"""A plug around an NVML-like object that splits chosen GPUs into MIG instances, as `nvidia-smi mig` does.

    nv = MigNVML(SimNVML("a100-40g", count=2), {0: 3})   # GPU 0 in MIG mode with three instances
    nv.mig_uuids(0)                                      # ['MIG-…', 'MIG-…', 'MIG-…']

MIG device handles answer what real ones answer: their UUID, their parent
(nvmlDeviceGetDeviceHandleFromMigDeviceHandle), and NOT_SUPPORTED for power, energy and limits,
which exist only for the whole GPU. The simulated GPU underneath stays one card: the plug keeps
MIG out of the simulator's own code.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import pynvml

MAX_MIG_DEVICES = 7  # an A100/H100 splits into at most seven instances


@dataclass(frozen=True)
class MigHandle:
    parent: object  # the wrapped library's handle of the whole GPU
    parent_index: int
    slot: int

    @property
    def index(self) -> int:  # the GPU a fault plug (faults.py) files it under: its parent
        return self.parent_index


class MigNVML:
    """Forwards everything to `lib`; GPUs named in `instances` (index → count) are in MIG mode."""

    def __init__(self, lib, instances: dict[int, int]):
        self.lib = lib
        self.instances = dict(instances)

    def __getattr__(self, name: str):
        attr = getattr(self.lib, name)
        if not (name.startswith("nvmlDevice") and callable(attr)):
            return attr

        def call(*args, **kw):
            if args and isinstance(args[0], MigHandle):
                raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)  # power, energy, limits: the whole GPU's only
            return attr(*args, **kw)

        return call

    def _parent_uuid(self, index: int) -> str:
        return self.lib.nvmlDeviceGetUUID(self.lib.nvmlDeviceGetHandleByIndex(index))

    def _mig_uuid(self, index: int, slot: int) -> str:
        h = hashlib.sha1(f"{self._parent_uuid(index)}/mig/{slot}".encode()).hexdigest()
        return f"MIG-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"

    def mig_uuids(self, index: int) -> list[str]:
        """The UUIDs `nvidia-smi -L` lists under GPU `index` (needs NVML initialised)."""
        return [self._mig_uuid(index, j) for j in range(self.instances.get(index, 0))]

    def _index(self, handle) -> int:
        return int(self.lib.nvmlDeviceGetIndex(handle))

    def nvmlDeviceGetMigMode(self, handle):
        if isinstance(handle, MigHandle):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        on = 1 if self.instances.get(self._index(handle)) else 0
        return [on, on]

    def nvmlDeviceGetMaxMigDeviceCount(self, handle) -> int:
        return MAX_MIG_DEVICES if self.instances.get(self._index(handle)) else 0

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle, slot: int) -> MigHandle:
        index = self._index(handle)
        if not 0 <= slot < self.instances.get(index, 0):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        return MigHandle(handle, index, slot)

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, handle):
        if not isinstance(handle, MigHandle):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return handle.parent

    def nvmlDeviceIsMigDeviceHandle(self, handle) -> int:
        return 1 if isinstance(handle, MigHandle) else 0

    def nvmlDeviceGetUUID(self, handle) -> str:
        if isinstance(handle, MigHandle):
            return self._mig_uuid(handle.parent_index, handle.slot)
        return self.lib.nvmlDeviceGetUUID(handle)

    def nvmlDeviceGetHandleByUUID(self, uuid):
        uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
        for index, n in self.instances.items():
            for slot in range(n):
                if self._mig_uuid(index, slot) == uuid:
                    return MigHandle(self.lib.nvmlDeviceGetHandleByIndex(index), index, slot)
        return self.lib.nvmlDeviceGetHandleByUUID(uuid)
