"""strata.engine.models."""
