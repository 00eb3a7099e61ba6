"""The ring model of a collective: how many steps it takes and how many bytes each rank sends.

NCCL and gloo run large all-gathers, reduce-scatters and all-reduces as rings. In a ring of
``n`` ranks the buffer is cut into ``n`` chunks and every step each rank passes one chunk to
its neighbour, so one pass round the ring takes ``n - 1`` steps and each rank sends (and
receives) ``(n - 1) / n`` of the buffer. An all-gather is one such pass (each rank forwards
the chunks it has not yet seen), a reduce-scatter is one (each rank adds its chunk to the one
it receives), and an all-reduce is a reduce-scatter followed by an all-gather: two passes,
``2 (n - 1)`` steps, ``2 (n - 1) / n`` of the buffer. A group of one rank sends nothing.

The buffer is the collective's full, unsharded size: an all-gather's output, a
reduce-scatter's input, an all-reduce's buffer. The cost model prices a collective from these
two numbers, the calibration fits measured timings against them, and the graph vocabulary
reports them, so all three agree on what a collective moves.
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
    if group_size <= 1:
        return 0.0
    share = (group_size - 1) / group_size
    return buffer_bytes * share * passes


def ring_steps(kind: str, group_size: int) -> int:
    """Neighbour-to-neighbour steps of a ``kind`` collective over ``group_size`` ranks: ``n - 1``
    per pass, 0 for ``n <= 1``."""
    passes = _passes(kind)
    return passes * (group_size - 1) if group_size > 1 else 0
