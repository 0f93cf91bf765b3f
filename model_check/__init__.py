"""Model checking of rowcache's transition table (spec/table.toml).

Layers, each importing only those above it:

- `table`: the specification (table schema and loader, reference host functions, the host
  half of a call, properties, mutants);
- `device`: the device semantics of the steps (explicit queues, happens-before summary);
- `search`: the `Model` interface, the two device models as models, breadth-first and
  memoized searches, the hypothesis machine;
- `z3`: the table over symbolic state (bounded model checking, inductive invariant);
- `render`: swimlanes and table diagrams;
- `config` (checked bounds, manifest), `cli` (`python -m model_check`) and `codegen`
  (`python -m model_check.codegen`).
"""
