"""Rendered prompts to generated samples: the stages, routing, budgets and every source kind."""
