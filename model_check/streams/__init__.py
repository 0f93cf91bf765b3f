"""The stream and event semantics of the table's steps (what the device does with them).

`interpreter.DeviceCall` runs one call's steps in table order (roles, `when` conditions, the
recorded trace) and hands each step to a primitive of the device model:

- `queues`: the explicit model, one FIFO per stream, event snapshots as references to queue
  prefixes, slot contents and the device map; every interleaving of device steps is a
  separate transition (the ground truth the summary is checked against);
- `hb` and `program`: the happens-before summary, where each pending operation keeps a mask
  of the places it happens before and every ordering verdict is decided when its second
  operation is enqueued, for all interleavings at once. `program` compiles a call's steps
  into primitives and evaluates them on pending operations packed into ints; `hb` adds the
  host-visible part of the state and the host call with its verdicts' messages.

The symbolic version of the summary is `model_check.z3.streams` (see `model_check.z3` for why it
stays separate). The device-planned path's steps have their own primitives (plans, gathers and
reads with their accesses): `device_program` interprets a call into them, `device_queues` and
`device_hb` are that path's explicit model and summary.
"""
