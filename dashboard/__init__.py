"""dashboard process package: thin wiring of the servelab core to its framework."""
