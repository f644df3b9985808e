from .measure import main

main()
