"""What a test counts as held memory: the distinct tensor and numpy storages reachable from some objects."""

from __future__ import annotations

import types

import numpy as np
import torch

__all__ = ["held_storages"]


def held_storages(*roots, arrays: bool = True, modules: bool = True) -> dict[int, tuple[int, tuple]]:
    """Unique tensor (and, with ``arrays``, numpy array) storages reachable from ``roots`` through attributes,
    containers, closures and bound methods (``torch.nn.Module`` attributes only with ``modules``): data pointer ->
    (bytes, shape).  Python modules are not entered."""
    seen, out, stack = set(), {}, list(roots)
    while stack:
        o = stack.pop()
        if id(o) in seen or isinstance(o, (str, bytes, int, float, bool, type(None), type, types.ModuleType)):
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            st = o.untyped_storage()
            out[st.data_ptr()] = (st.nbytes(), tuple(o.shape))
        elif isinstance(o, np.ndarray):
            if arrays:
                base = o
                while isinstance(base.base, np.ndarray):
                    base = base.base
                out[base.__array_interface__["data"][0]] = (base.nbytes, tuple(o.shape))
        elif isinstance(o, dict):
            stack.extend(o.keys())
            stack.extend(o.values())
        elif isinstance(o, (list, tuple, set, frozenset)):
            stack.extend(o)
        else:
            if isinstance(o, types.FunctionType) and o.__closure__:
                stack.extend(c.cell_contents for c in o.__closure__ if c.cell_contents is not None)
            if isinstance(o, types.MethodType):
                stack.append(o.__self__)
            if hasattr(o, "__dict__") and (modules or not isinstance(o, torch.nn.Module)):
                stack.extend(vars(o).values())
    return out
