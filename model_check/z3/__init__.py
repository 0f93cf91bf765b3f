"""The table over symbolic state, with z3: the reference host functions written once over
values that may be symbolic (`host`), the happens-before summary following one generic
operation per kind (`streams`), bounded model checking (`bmc`), the inductive invariant
(`induction`) and the report of both (`check`, `python -m model_check.z3.check`); the
device-planned path's encoding (`device_path`), checked through the same unrolling base,
queries and induction.

Why the device semantics is written again here rather than shared with `model_check.streams`:
the state is symbolic (a mask is a tuple of z3 terms, a `when` condition is a path condition
that guards every update instead of a Python branch), and the encoding follows one pending
operation of each kind chosen nondeterministically instead of the set of pending operations,
which is what makes the induction's state finite and independent of the bounds. What is
shared is the interpreter: `Z3Call` is a `DeviceCall`, so the order of steps, the stream
roles and the trace are those of every other model (see `streams` for the abstraction).
"""
