"""The model: its config, its weights in the engine's layout, and the decoder composed from layers."""
