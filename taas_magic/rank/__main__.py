from taas_magic.rank import lifeline
from taas_magic.rank.main import main

try:
    main()
finally:  # main() ends in os._exit; this covers a rank that ends any other way
    lifeline.end_watchdog()
