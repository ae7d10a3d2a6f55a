"""stapo.tasks."""
