"""What tests share besides fixtures (those are in tests/conftest.py): helpers, the test lanes' guard,
imported as `support.<module>` (pyproject.toml puts tests/ on the path; one copy of each module).
"""
