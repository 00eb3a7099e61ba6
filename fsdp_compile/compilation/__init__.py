"""The compile pipeline around the passes: what happens to a graph from Dynamo to the inner compiler.

* :mod:`.compiler`: :class:`~.compiler.Compiler`, the stages in order (captured, joint,
  partition, graph passes) for one captured graph;
* :mod:`.inner`: the inner compilers the stages run inside (``aot_eager``, Inductor's hooks);
* :mod:`.guard`: the per-call guard every compiled graph runs behind;
* :mod:`.records`: :class:`~.records.CompiledGraph`, what the pipeline produced for a graph;
* :mod:`.cache`: the compile cache and its key (warm restarts);
* :mod:`.planning_seam`: the pipeline on fake tensors, for the planner.

The passes themselves live in :mod:`fsdp_compile.passes`.
"""
