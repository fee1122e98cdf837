"""Hidden-state extraction and the hand-off into training; the export served on held-out prompts."""
