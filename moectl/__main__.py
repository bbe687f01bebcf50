from moectl.cli.app import main

main()
