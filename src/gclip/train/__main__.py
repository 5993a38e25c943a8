"""``python -m gclip.train``: see the package's docstring."""

from .command import main

__all__ = ["main"]

if __name__ == "__main__":
    main()
