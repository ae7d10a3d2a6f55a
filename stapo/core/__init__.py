"""stapo.core."""
