from tierwise.cli import main

main()
