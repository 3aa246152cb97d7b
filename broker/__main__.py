"""``python -m broker`` runs the ``fleet`` CLI."""

from broker.cli import main

main()
