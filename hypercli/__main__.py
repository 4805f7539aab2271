"""``python -m hypercli`` runs the ``hyper`` command line."""

from hypercli.cli import main

if __name__ == "__main__":
    main()
