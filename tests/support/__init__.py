"""Helpers shared by the test packages (importable as `support.*`: pytest puts tests/ on sys.path)."""
