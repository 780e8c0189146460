"""Only rank 0 writes to the repository.

The kernel's rule and report (rule.py), the rank's namespace and overlay (namespace.py),
and the Python fallback where namespaces are forbidden (divert.py, over layer.py).
"""
