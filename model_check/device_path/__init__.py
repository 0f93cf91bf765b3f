"""The device-planned path of the table: its operations, their semantics and its checkers.

The device-planned provider (rowcache.device_plan) plans and copies on the device, on the
stream that runs the layer, so a forward can be captured in a CUDA graph and replayed on
another stream. Its entries of the transition table (`[device]` in spec/table.toml) are
interpreted here: core.py (the interpreter shared by the device models, the properties),
explicit.py (every interleaving), hb.py (the happens-before summary), z3_check.py (bounded
model checking and an inductive invariant), machine.py (hypothesis), mutants.py (the seeded
bugs), checks.py (bounds, runs, kill matrix). spec/README.md, "The device-planned path",
states the semantics and what the model abstracts.
"""
