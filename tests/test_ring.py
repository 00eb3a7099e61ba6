"""The ring model every part shares (runtime/ring.py): what each collective sends per rank."""

from __future__ import annotations

import pytest

from fsdp_compile.runtime.ring import ring_steps, wire_bytes


@pytest.mark.parametrize("n", [2, 4, 8])
def test_one_pass_sends_all_but_ones_own_chunk_and_an_all_reduce_two(n: int) -> None:
    buffer = 1024 * n
    for kind in ("all_gather", "reduce_scatter"):
        assert wire_bytes(kind, buffer, n) == buffer * (n - 1) / n
        assert ring_steps(kind, n) == n - 1
    assert wire_bytes("all_reduce", buffer, n) == 2 * buffer * (n - 1) / n
    assert ring_steps("all_reduce", n) == 2 * (n - 1)


def test_a_group_of_one_sends_nothing_and_an_unknown_kind_is_refused() -> None:
    assert wire_bytes("all_reduce", 4096, 1) == 0 and ring_steps("all_gather", 1) == 0
    with pytest.raises(ValueError, match="no ring model for collective 'broadcast'"):
        wire_bytes("broadcast", 4096, 2)
