"""The library's typed errors: an argument of an attention call is wrong.

Both are ``ValueError`` (docs/API.md section 5 promises one for a bad argument, with a
message that names it: "x must be ..., got ..."), so a caller that catches ``ValueError``
sees no change. The service tells them apart by class, never by message: its one table
(``service/core/errors.py``) answers each where a client's input went through a check.
"""

from __future__ import annotations


class InvalidInput(ValueError):
    """A tensor argument is wrong: its shape, dtype, heads, positions or values (``workers.problem``)."""


class InvalidAttentionOption(ValueError):
    """An attention option is wrong: ``scale``, ``causal``, ``window`` or ``softcap`` (``AttentionOptions``)."""
