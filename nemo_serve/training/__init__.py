"""Training recipe for the embedded demo model (corpus generation, training, streaming evaluation)."""
