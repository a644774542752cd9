"""``python -m services.cli``: how ``rollstream run`` starts its services."""

from services.cli import main

main()
