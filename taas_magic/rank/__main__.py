"""``python -m taas_magic.rank``: a rank, a warm spare (``--spare``), or the spare factory (``--factory FD``).

Runs in each rank and spare (rank/main.py), and in the spare factory (rank/factory.py, which never
returns here: each fork it makes goes on as a spare), on the process's main thread.
"""

import sys

from taas_magic.rank import lifeline

if "--factory" in sys.argv:  # the spare factory (factory.py): imports once, forks the spares
    import socket

    from taas_magic.rank.factory import serve

    serve(socket.socket(fileno=int(sys.argv[sys.argv.index("--factory") + 1])), step="--step" in sys.argv,
          compiler="--compiler" in sys.argv)

from taas_magic.rank.main import main

try:
    main()
finally:  # main() ends in os._exit; this covers a rank that ends any other way
    lifeline.end_watchdog()
