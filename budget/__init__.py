"""strata.budget."""
