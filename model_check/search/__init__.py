"""Searches over models of the table.

`model.Model` (and `model.FactoredModel`) is the interface a search needs; `models` makes the
two device models of `model_check.streams` into models (`device_models`: the device-planned
path's); `bfs.bfs` explores any model, `memo.memo_search` any factored one with memoized
halves; `explore.explore` runs one check of either path's table by model name; `machine`
drives both device models in lockstep with hypothesis (`device_machine`: the device path's).
"""

from model_check.search.explore import explore
from model_check.search.model import FactoredModel, Model, Result

__all__ = ["FactoredModel", "Model", "Result", "explore"]
