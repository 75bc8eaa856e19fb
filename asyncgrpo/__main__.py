"""``python -m asyncgrpo`` (and ``torchrun -m asyncgrpo``): the ``asyncgrpo`` command."""

from asyncgrpo.cli.main import main

if __name__ == "__main__":
    main()
