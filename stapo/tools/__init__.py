"""stapo.tools."""
