"""The device-planned path: planning and miss copies run on the device, inside CUDA graphs.

Per layer the device holds the cache state (``state.DeviceCacheState``: resident map, slot
owners, last-use stamps, counters). One pass of a forward is a planner launch, which reads
``topk_ids`` on the device and writes the forward map and a miss list, and a gather launch,
which copies the listed experts from pinned host memory into their slots. Both have fixed shapes
and never synchronize with the host, so a whole forward, misses included, is captured once and
replayed. The policy is the host path's (``rowcache.row_provider``): victim protection over
the step and the same victim choice (least recently used, or with ``policy="lfu"`` fewest
requests: ``rowcache.policy``), so the model's reference decides every step of both.

Modules, one job each:

* ``state``: the device tensors of one layer's cache and the error report read off them;
* ``passes``: how many passes a step of a given size needs;
* ``torch_planner``: the planner as plain torch operations (CPU tests, the reference);
* ``triton_planner``: the same planner fused into one Triton launch (CUDA);
* ``regions``: the byte ranges a miss copies, per layout;
* ``gather``: the miss copies (torch on the CPU, one Triton launch on CUDA);
* ``streams``: the streams and events the provider's handoff runs on (the handoff itself is
  generated from the table: ``rowcache.schedules._device_generated``);
* ``provider``: ``DevicePlannedProvider``, the surface the forward and vLLM use.
"""
