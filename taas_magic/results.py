"""Rank 0's names -> the notebook namespace; its final expression -> the cell's ``Out``."""

from __future__ import annotations

import sys
from typing import Any

import cloudpickle


def apply_results(user_ns: dict[str, Any], message: dict | None) -> Any:
    """Bind what rank 0 sent back; return its final value (or None).

    Names that could not come back are listed in one line on stderr; the rest arrive.
    """
    if message is None:
        return None
    failed = list(message["failed"])
    try:
        payload = cloudpickle.loads(message["blob"])
    except Exception as exc:  # noqa: BLE001 - e.g. a class importable only in the ranks
        print(f"taas: rank 0's results could not be loaded in the kernel: {type(exc).__name__}: {exc}", file=sys.stderr)
        return None
    user_ns.update(payload["names"])
    for name in message["deleted"]:
        user_ns.pop(name, None)
    if failed:
        listed = ", ".join(f"{name} ({reason})" for name, reason in failed)
        print(f"taas: {len(failed)} name(s) could not come back from rank 0 and keep their old value: {listed}", file=sys.stderr)
    return payload["final"] if payload["has_final"] else None
