"""asv benchmark suite of fastattn (see asv.conf.json at the repository root)."""
