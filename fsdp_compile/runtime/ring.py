"""The ring model of a collective: how many steps it takes and how many bytes each rank sends.

In a ring of ``n`` ranks one pass takes ``n - 1`` steps and each rank sends ``(n - 1) / n`` of
the buffer (the collective's full, unsharded size); an all-gather or a reduce-scatter is one
pass, an all-reduce two. The cost model, the calibration and the graph vocabulary all read these
two numbers, so they agree on what a collective moves.
"""

from __future__ import annotations

# Passes round the ring each collective makes.
_PASSES = {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 2}


def _passes(kind: str) -> int:
    # An unknown kind (a broadcast, an all-to-all) moves bytes differently: refuse to guess.
    if kind not in _PASSES:
        raise ValueError(f"no ring model for collective {kind!r}; kinds are {', '.join(_PASSES)}")
    return _PASSES[kind]


def wire_bytes(kind: str, buffer_bytes: float, group_size: int) -> float:
    """Bytes each rank sends (and receives) for a ``kind`` collective of ``buffer_bytes`` over
    ``group_size`` ranks: ``(n - 1) / n`` of the buffer per pass, 0 for ``n <= 1``.

    ``buffer_bytes`` may also be a symbolic size (a sympy expression, from a graph traced with
    symbolic shapes); the result is then an expression too.
    """
    passes = _passes(kind)
    return buffer_bytes * ((group_size - 1) / group_size) * passes if group_size > 1 else 0.0


def ring_steps(kind: str, group_size: int) -> int:
    """Neighbour-to-neighbour steps of a ``kind`` collective over ``group_size`` ranks: ``n - 1``
    per pass, 0 for ``n <= 1``."""
    passes = _passes(kind)
    return passes * (group_size - 1) if group_size > 1 else 0
