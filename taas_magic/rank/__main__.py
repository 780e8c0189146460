from taas_magic.rank.main import main

main()
