"""The invariant of every graph handed to the inner compiler: a collective's buffers are left
alone until its wait, as the communication library reads and writes them from its own threads or
stream: its only user is its wait, and nothing in between writes a storage they live on.
"""

from __future__ import annotations

import torch.fx as fx

from .context import PassContext
from .graph import WAIT, is_collective, storage_keys


class InflightBufferError(RuntimeError):
    """A graph touches a collective's buffer before its wait."""


def _written(node: fx.Node) -> list[fx.Node]:
    """The arguments ``node`` writes to (its schema's mutable arguments)."""
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None:
        return []
    written = []
    for i, argument in enumerate(schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = node.args[i] if i < len(node.args) else node.kwargs.get(argument.name)
        written += [v for v in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(v, fx.Node)]
    return written


def check_inflight_buffers(graph: fx.Graph) -> int:
    """Raise :class:`InflightBufferError` where ``graph`` breaks the rule; returns collectives checked."""
    nodes = list(graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    checked = 0
    for start in nodes:
        if not is_collective(start):
            continue
        users = list(start.users)
        if len(users) != 1 or users[0].target is not WAIT:
            raise InflightBufferError(f"collective {start.name} ({start.target}) must have its wait as its only "
                                      f"user; its users are {[u.name for u in users] or 'none'}")
        wait = users[0]
        buffers = storage_keys(start.args[0].meta.get("val")) | storage_keys(start.meta.get("val"))
        for node in nodes[position[start] + 1:position[wait]]:
            for target in _written(node):
                if storage_keys(target.meta.get("val")) & buffers:
                    raise InflightBufferError(f"{node.name} ({node.target}) writes to {target.name}, which shares a "
                                              f"buffer with collective {start.name} before its wait {wait.name}")
        checked += 1
    return checked


def check_inflight_buffers_pass(gm: fx.GraphModule, ctx: PassContext) -> int:
    """Each graph, last: checks (rewrites nothing) that no collective's buffers are touched before its wait."""
    return check_inflight_buffers(gm.graph)
