"""What runs inside a rank process: ``python -m taas_magic.rank``.

Nothing here imports IPython or torch eagerly: a rank pays for what its cell uses.
"""
