"""The state algebra of split-key attention (README, "The math").

Imports only the standard library and numpy.
"""

from merge.combine import merge, merge_all, merge_group, tree_levels
from merge.state import NO_SCORE, STATE_DTYPES, State, array_module, empty, finalize, from_lse

__all__ = [
    "NO_SCORE",
    "STATE_DTYPES",
    "State",
    "array_module",
    "empty",
    "finalize",
    "from_lse",
    "merge",
    "merge_all",
    "merge_group",
    "tree_levels",
]
