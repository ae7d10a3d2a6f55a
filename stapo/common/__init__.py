"""stapo.common."""
