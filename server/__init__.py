"""tqserve server."""
