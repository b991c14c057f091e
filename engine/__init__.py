"""strata.engine."""
