"""``python -m cli``: how ``rollstream run`` starts its services."""

from cli import main

main()
