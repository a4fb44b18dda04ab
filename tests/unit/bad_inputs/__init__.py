"""The bad-input table of tests/unit/test_bad_inputs.py, one module per area."""
