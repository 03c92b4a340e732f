"""The names op modules import, from where they live now: the op table (ops/table.py), the dispatch path and
the kernel entry (ops/dispatch.py), and the rule helpers (ops/rules.py). New code imports from those."""
from ..runtime.kernels import broadcast_shape as _broadcast_shape  # noqa: F401
from .dispatch import (OpPlan, _LAST, _PLANS, _last1_get, _plan, describe, dispatch, local_map,  # noqa: F401
                       make_plan, plan_of, stats)
from .rules import meta_call, replicated, spec_like, static_value, to_dtensors  # noqa: F401
from .table import (FUNCTIONAL, PUBLIC, TABLE, TORCH_FUNCTIONS, Op, UnsupportedError, missing_attribute,  # noqa: F401
                    register, torch_function_dispatch, torch_public_name, unsupported_message, write_out)
