"""Model checking of rowcache's transition table (spec/table.toml).

Layers, each importing only those above it:

- `table`: the specification (table schema and loader, reference host functions, the host
  half of a call, properties, mutants);
- `streams`: the CUDA stream and event semantics of the steps (explicit queues,
  happens-before summary);
- `search`: the `Model` interface, the two device models as models, breadth-first and
  memoized searches, the hypothesis machine;
- `z3`: the table over symbolic state (bounded model checking, inductive invariant);
- `render`: swimlanes and table diagrams;
- `config` (checked bounds, manifest), `cli` (`python -m model_check`) and `codegen`
  (`python -m model_check.codegen`).

Both sections of the table go through the same layers: the host path's operations (steps a
host call enqueues on streams) and the device-planned path's (`[device]`: plans and copies
that run on the stream of the layer, captured and replayed), whose part of a layer is in its
`device_*` modules (`table.device_functions`, `streams.device_program`, `device_queues`,
`device_hb`, `search.device_models`, `device_machine`, `z3.device_path`).
"""
