"""Configuration and database plumbing of the collector."""
