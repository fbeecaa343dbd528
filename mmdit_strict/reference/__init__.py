"""Independent CPU references (FP64) of every model operator and of the whole Qwen-Image forward.

Shares no code with :mod:`mmdit_strict.kernels` or :mod:`mmdit_strict.model` (docs/design.md §3, §10): tests
check kernels and models against these. Written for clarity, not speed.

The package exports what its modules export: the operators (:mod:`.ops`), the RoPE positions and tables
(:mod:`.rope`) and the whole forward (:mod:`.model`); each module's ``__all__`` is the one list of its names.
"""

from mmdit_strict.reference import model, ops, rope
from mmdit_strict.reference.model import *  # the names in model.__all__
from mmdit_strict.reference.ops import *  # the names in ops.__all__
from mmdit_strict.reference.rope import *  # the names in rope.__all__

__all__ = model.__all__ + ops.__all__ + rope.__all__
