"""The schema of each store backend, as the ordered steps that build and upgrade it."""
