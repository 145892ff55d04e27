"""tqserve parallel."""
