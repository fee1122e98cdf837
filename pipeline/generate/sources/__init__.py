"""The source kinds (registry), the routed chain of source stages."""
