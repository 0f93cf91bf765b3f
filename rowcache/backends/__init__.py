"""Backends: what each step of the table does on a device.

``base`` defines the ``Backend`` protocol the generated schedules call; ``cpu`` runs the steps
synchronously, ``recording`` records them in the model's trace format, and ``cuda`` (imported
on demand, the only module touching ``torch.cuda``) enqueues them on CUDA streams.
"""

from rowcache.backends.base import Backend, ConsumerBackend, Plan, Roles
from rowcache.backends.cpu import CpuBackend
from rowcache.backends.recording import RecordingBackend

__all__ = ["Backend", "ConsumerBackend", "CpuBackend", "Plan", "RecordingBackend", "Roles"]
