from deploykit.cli import main

main()
