"""strata.packer."""
