"""Command-line front ends above everything: the console scripts (entry_points), the ``--dry-run`` cost estimate and
the token viewer."""
