"""kvfleet_gateway: the token-aware gateway (auth, limits, budgets, routing, streaming proxy)."""
