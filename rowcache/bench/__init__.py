"""``python -m rowcache.bench``: the provider benchmark of issue 4 (part 1).

One module per job:

* ``geometry``: the expert layouts (bf16, NVFP4-like, one 100.7 MB bf16 expert) and their
  pinned host sources.
* ``providers``: ``row`` (batched copies), ``row_packed`` (the same with the packed slot
  layout: one range per miss), ``row_pt`` (the row provider with one copy per tensor per miss)
  and the ``cached`` LFRU baseline.
* ``ceilings``: pinned host-to-device bandwidth by copy size, timed with CUDA events.
* ``steps``: requests that produce an exact number of misses on a given provider.
* ``cells``: host and device time of ``prepare`` per provider, geometry and miss count, and
  the copy path's own time (CUDA events on the copy stream around the copy call) where the
  provider has a CUDA backend.
* ``trace``: a seeded synthetic routing trace with temporal locality, and its replay.
* ``report``: the JSON document and the text table.
* ``plot``: the PNG of miss-path GB/s against misses (matplotlib, Agg).

Only ``ceilings``, ``cells`` and ``trace`` need CUDA; the rest runs anywhere, so that the PNG
can be rendered on a machine without a GPU from the JSON (``--plot-from``).
"""
