"""Several gateways on one database (SPEC §10): leases with fencing tokens, and leadership."""
