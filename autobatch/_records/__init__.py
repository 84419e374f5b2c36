"""Records: what a search or a timing found (and its JSON form), its plot, its trials shown as
they end, and the cache that stores it."""
