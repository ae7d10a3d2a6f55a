"""stapo.model."""
