"""tqserve model_zoo."""
