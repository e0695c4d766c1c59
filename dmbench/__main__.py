"""``python -m dmbench``: the same app as the ``dmbench`` console script."""

from dmbench.cli import main

main()
