"""`qconv bench`: serving speed by workload."""
