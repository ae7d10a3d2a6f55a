"""stapo.run."""
