"""What rank 0 sends back: the names its cell bound or changed, and its final value.

Before the cell runs, rank 0 notes the identity of every name in its namespace and a
digest of each shipped data value. Afterwards a name comes back when it is new,
rebound, or (for shipped data) changed in place, so ``model.train()`` on a notebook
model comes back too; a shipped name the cell deleted is deleted in the notebook.

Everything is pickled together (so ``optimizer`` keeps pointing at ``model``'s
parameters); a name that cannot be pickled is left out and listed, and the rest come
back. CUDA tensors are moved to CPU when the kernel has no CUDA.
"""

from __future__ import annotations

import hashlib
import sys
import types
from typing import Any

import cloudpickle

_CODE_TYPES = (types.ModuleType, types.FunctionType, types.BuiltinFunctionType, type)


class _ReturnPickler(cloudpickle.Pickler):
    def __init__(self, file, cuda_to_cpu: bool):
        super().__init__(file, protocol=5)
        self._cuda_to_cpu = cuda_to_cpu

    def reducer_override(self, obj):
        torch = sys.modules.get("torch") if self._cuda_to_cpu else None
        if torch is not None and isinstance(obj, torch.Tensor) and obj.device.type == "cuda":
            cpu = obj.detach().to("cpu")
            if isinstance(obj, torch.nn.Parameter):
                cpu = torch.nn.Parameter(cpu, requires_grad=obj.requires_grad)
            elif obj.requires_grad:
                cpu.requires_grad_(True)
            return cpu.__reduce_ex__(5)
        return super().reducer_override(obj)


def dumps(obj: Any, cuda_to_cpu: bool) -> bytes:
    import io

    buffer = io.BytesIO()
    _ReturnPickler(buffer, cuda_to_cpu).dump(obj)
    return buffer.getvalue()


def _digest(value: Any) -> bytes | None:
    if isinstance(value, _CODE_TYPES):
        return None
    try:
        return hashlib.blake2b(cloudpickle.dumps(value, protocol=5), digest_size=16).digest()
    except Exception:  # noqa: BLE001 - unpicklable data is compared by identity only
        return None


def snapshot(namespace: dict[str, Any], shipped: set[str]) -> dict[str, tuple[int, bytes | None]]:
    return {
        name: (id(value), _digest(value) if name in shipped else None) for name, value in namespace.items()
    }


def changed_names(
    namespace: dict[str, Any], before: dict[str, tuple[int, bytes | None]], private: set[str]
) -> tuple[list[str], list[str]]:
    """Names to send back, and shipped names the cell deleted."""
    changed = []
    for name, value in namespace.items():
        if name in private or name.startswith("__"):
            continue
        seen = before.get(name)
        if seen is None or seen[0] != id(value):
            changed.append(name)
        elif seen[1] is not None and _digest(value) != seen[1]:
            changed.append(name)
    deleted = [name for name in before if name not in namespace and name not in private]
    return changed, deleted


def pack_returns(
    namespace: dict[str, Any], names: list[str], final: Any, has_final: bool, cuda_to_cpu: bool
) -> tuple[bytes, list[tuple[str, str]]]:
    """Pickle the names and final value together; leave out and list what cannot be pickled."""
    values = {name: namespace[name] for name in names}
    failed: list[tuple[str, str]] = []
    try:
        return dumps({"names": values, "final": final, "has_final": has_final}, cuda_to_cpu), failed
    except Exception:  # noqa: BLE001
        pass
    items = dict(values, **({"<final value>": final} if has_final else {}))
    for name, value in items.items():
        try:
            dumps(value, cuda_to_cpu)
        except Exception as exc:  # noqa: BLE001
            failed.append((name, f"{type(value).__name__}: {type(exc).__name__}"))
    bad = {name for name, _ in failed}
    values = {name: value for name, value in values.items() if name not in bad}
    keep_final = has_final and "<final value>" not in bad
    return dumps({"names": values, "final": final if keep_final else None, "has_final": keep_final}, cuda_to_cpu), failed
