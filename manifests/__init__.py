"""strata.manifests."""
