"""The compile pipeline around the passes: what happens to a graph from Dynamo to the inner compiler.

:mod:`.pipeline` (the stages in order, and the tracing door) uses the other modules, which
never import it back; docs/design.md's layout says what each holds. The layers above use what
this package exports here; the passes themselves live in :mod:`fsdp_compile.passes`.
"""

from .inner_compilers import collector_paused
from .pipeline import Compiler
from .records import CompiledGraph, JointCapture
from .stage_log import StrictFallbackError

__all__ = ["CompiledGraph", "Compiler", "JointCapture", "StrictFallbackError", "collector_paused"]
