"""The compile pipeline around the passes: what happens to a graph from Dynamo to the inner compiler.

* :mod:`.pipeline`: :class:`~.pipeline.Compiler`, the stages in the order a captured graph
  goes through them (captured, joint, partition, graph stage, inner compiler), and the one
  door for tracing without code generation (``trace``, ``replay``, ``trace_step``);
* :mod:`.inner_compilers`: ``aot_eager`` and Inductor, each handed the same stages;
* :mod:`.guard`: the per-call guard every compiled graph runs behind;
* :mod:`.records`: :class:`~.records.CompiledGraph`, what the pipeline produced for a graph;
* :mod:`.roles`: what forward outputs are, and the roles backward's saved inputs inherit;
* :mod:`.inputs`: what a captured graph's inputs must be; a graph that only reads a parameter;
* :mod:`.stage_log`: dumps and pass failures;
* :mod:`.contexts`: what each stage's passes are told about the backend;
* :mod:`.tracing`: running a step through ``torch.compile`` to trace it;
* :mod:`.cache`: the compile cache and its key (warm restarts);
* :mod:`.marker_args`: a joint graph's markers rewritten to another backend's arguments.

:mod:`.pipeline` uses the others; none of them imports it back. The layers above (the planner,
the backend) use what this package exports here. The passes themselves live in
:mod:`fsdp_compile.passes`.
"""

from .inner_compilers import collector_paused
from .pipeline import Compiler
from .records import CompiledGraph, JointCapture
from .stage_log import StrictFallbackError

__all__ = ["CompiledGraph", "Compiler", "JointCapture", "StrictFallbackError", "collector_paused"]
