"""Operators, one module per op family. Importing this package fills the op table (``table.TABLE``)."""
from . import table
from . import factory, pointwise, view, cat, reduce, whole_dim, matrix, nn, attention, inplace, loss, conv  # noqa: F401
from . import index, index_put, gather, pool, norm2d, misc  # noqa: F401
from . import random  # noqa: F401
from . import view_select, view_writes  # noqa: F401  (views: select/diagonal, writes through views)

TABLE = table.TABLE
# what dtorch.Tensor takes from the op layer besides the table (Tensor._install_ops)
TENSOR_HOOKS = {"torch_function": table.torch_function_dispatch, "cast": pointwise.to_dtype,
                "missing_attribute": table.missing_attribute}
