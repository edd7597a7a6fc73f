"""``python -m marspec.eagle3_training``: train an EAGLE-3 head (see :mod:`marspec.eagle3_training`)."""

from marspec.eagle3_training.cli import main

if __name__ == "__main__":
    main()
