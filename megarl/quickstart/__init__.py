"""The CPU quickstarts: inputs for a small RL run built on this machine, nothing from a hub.

- `inputs`: `prepare` (the Search-R1 search world, its BM25 index and a warmed-up tiny
  model), `prepare_math` (single-turn arithmetic for DAPO and its tiny model) and
  `prepare_code` (programming problems for the sandboxed code reward, and its tiny model),
  `prepare_tools` (products to compute, and a tiny model that calls a tool sometimes).
- `worlds`: the synthetic worlds themselves (invented facts to search for, one-digit sums)
  and the warm-up demonstrations drawn from them.
- `sft`: `supervised_warmup`, the short supervised phase that gives the tiny model the
  response format before RL.
- `code_task`: the programming problems (open-r1 code rows) and their demonstrations.
- `tool_task`: the tool-use world (products of two-digit numbers) and its demonstrations.
- `__main__`: `python -m megarl.quickstart prepare|prepare-math|prepare-code|prepare-tools DIR`.

The quickstarts build on the rest of megarl (megarl.data, megarl.retrieval, the torch
backend); nothing outside this package imports it. Main entry points: `prepare`, `prepare_math`,
`prepare_code`, `prepare_tools`.
"""

from megarl.quickstart.inputs import (CodeSettings, MathSettings, QuickstartSettings, ToolSettings, prepare,
                                     prepare_code, prepare_math, prepare_tools)

__all__ = ["CodeSettings", "MathSettings", "QuickstartSettings", "ToolSettings", "prepare", "prepare_code",
           "prepare_math", "prepare_tools"]
