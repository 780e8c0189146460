import sys

from taas_magic.rank import lifeline

if "--factory" in sys.argv:  # the spare factory (factory.py): imports once, forks the spares
    import socket

    from taas_magic.rank.factory import serve

    serve(socket.socket(fileno=int(sys.argv[sys.argv.index("--factory") + 1])), step="--step" in sys.argv)

from taas_magic.rank.main import main

try:
    main()
finally:  # main() ends in os._exit; this covers a rank that ends any other way
    lifeline.end_watchdog()
