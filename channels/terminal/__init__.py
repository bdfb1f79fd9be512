"""The terminal as a channel: replies printed as they stream in, and reading the person's lines."""
