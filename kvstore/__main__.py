"""``python -m kvstore``: the command-line interface."""

from kvstore.cli.main import main

if __name__ == "__main__":  # pragma: no cover
    main()
