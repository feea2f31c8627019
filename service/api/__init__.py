"""HTTP layer of the collector: dependencies, problem+json errors and routes."""
