"""``python -m rlpipe.cli …``: the same as the ``rlpipe`` console script."""

from rlpipe.cli import main

main()
