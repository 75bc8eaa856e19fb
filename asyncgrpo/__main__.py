"""``python -m asyncgrpo`` (and ``torchrun -m asyncgrpo``): the ``asyncgrpo`` command."""

from asyncgrpo.cli import main

if __name__ == "__main__":
    main()
