from traceinspect.cli import main

main()
