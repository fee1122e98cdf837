"""HTTP API sources (OpenRouter): wire format, journal, replay, circuit, budget client."""
