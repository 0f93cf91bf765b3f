"""The table over symbolic state, with z3: the reference host functions written once over
values that may be symbolic (`host`), the happens-before summary following one generic
operation per kind (`device`), bounded model checking (`bmc`), the inductive invariant
(`induction`) and the report of both (`check`, `python -m model_check.z3.check`).

Why the device semantics is written again here rather than shared with `model_check.device`:
the state is symbolic (a mask is a tuple of z3 terms, a `when` condition is a path condition
that guards every update instead of a Python branch), and the encoding follows one pending
operation of each kind chosen nondeterministically instead of the set of pending operations,
which is what makes the induction's state finite and independent of the bounds. What is
shared is the interpreter: `Z3Call` is a `DeviceCall`, so the order of steps, the stream
roles and the trace are those of every other model (see `device` for the abstraction).
"""
