from deploykit.cli import main

if __name__ == "__main__":  # not when serve --workers spawns a worker, which imports this module again
    main()
